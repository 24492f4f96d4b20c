"""The whole per-sample CPU pipeline of a policy: decode -> crop (random resized, centre, keep-ratio) ->
flip -> colour jitter -> grayscale -> policy ops -> uint8 CHW (or normalised float32) -> random erasing, written into a
caller-provided buffer.

This is what a CPU worker runs; its output for (seed, epoch, index) equals the DALI pipeline's up
to the per-op tolerances in tests/test_ops_dali.py.
"""

from __future__ import annotations

import time
from functools import partial

import cv2
import numpy as np
from PIL import Image

from fusionflow.ops import augmix, augmix_torchvision, exact, fast, jpeg
from fusionflow.ops.cached import crop_cached
from fusionflow.ops.decode import decode_crop_resize, decode_crop_resize_array, load_rgb, open_image
from fusionflow.ops.decode_filtered import decode_box_resize, decode_crop_resize_filtered, fast_bicubic_array
from fusionflow.ops.deepaa_order import authors_image
from fusionflow.ops.stages import BLUR, GRAYSCALE
from fusionflow.policy import Policy, SampleDraw, crop_window, draw, keep_ratio, load_policy
from fusionflow.policy.sampling import center_layout, crop_plan, trim_side


class CpuPipeline:
    """Runs a policy on one sample at a time. Holds no per-sample state; cheap to call.

    exact mode works on Pillow images (torchvision's PIL path, to the bit); fast mode on uint8 HWC
    arrays from the window decoder to the ring, with each op's fastest kernel
    (fusionflow/ops/fast.py) and OpenCV's split writing the planes straight into the slot."""

    def __init__(self, policy, cache=None):
        """`cache`: a fusionflow.ops.cached.CacheReader (fast mode only), or None."""
        self.policy: Policy = load_policy(policy)
        self.cache = cache if self.policy.fast_downscale else None
        aug = self.policy.augment
        self.style = exact.Style(aug.interpolation, aug.fill)
        # ops whose interpolation is drawn per op (timm's 'random') carry it: one style per filter
        self._styles = {name: exact.Style(name, aug.fill) for name in exact.RESAMPLE}
        self.out_shape = self.policy.out_shape
        self.out_dtype = np.dtype(self.policy.out_dtype)
        self.fast = self.policy.fast_downscale
        deepaa = aug.deepaa
        self.authors_order = deepaa is not None and deepaa.order == "authors"
        if self.authors_order:
            self.cache = None  # it decodes whole images at their own size
        self._kernels = fast.FAST  # used in fast mode only; exact mode runs exact.py on Pillow images
        if self.policy.normalize:
            mean, std = (np.asarray(v, np.float32).reshape(3, 1, 1) for v in self.policy.normalize)
            self._scale, self._shift = 1.0 / (255.0 * std), -mean / std
            self._gain, self._bias = [float(v) for v in self._scale.ravel()], [float(v) for v in self._shift.ravel()]
        jpeg.available()  # build/load the window decoder now (once, logged if it cannot), not on a sample
        missing = [o.name for o in aug.ops if o.name not in exact.CPU_IMPLS]
        if missing:
            raise ValueError(f"{self.policy.source}: no CPU implementation for ops {missing}")
        if aug.type == "augmix" and not self.fast and augmix_torchvision.available() is not None:
            raise ValueError(f"{self.policy.source}: {augmix_torchvision.available()}; or use decode.mode fast")

    def image(self, data, d: SampleDraw, what: str | None = None, tick=None) -> Image.Image:
        """The augmented sample as an RGB image of the output size. `tick(stage)`, if given, is called
        after each stage (fusionflow/ops/stages.py)."""
        p = self.policy
        if p.center_resize is not None or p.keep_ratio is not None:  # the unrounded box crops
            img = self._boxed(data, d, what)
        elif (d.crop_resample or p.crop_interpolation) != "bilinear":
            img = self._filtered(data, d, what)
        else:
            img = decode_crop_resize(data, partial(crop_window, p, d), p.size, p.fast_downscale, what, p.max_pixels)
        if tick is not None:
            tick("decode+crop+resize")
        if d.flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if d.vflip:
            img = img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        if tick is not None:
            tick("flip")
        after = self.policy.color_after_augment
        img = img if after else self._color_image(img, d, tick)
        img = self.augment_image(img, d, tick)
        img = self._color_image(img, d, tick) if after else img
        if d.blur is not None:  # torchvision's own kernel: the reference's pixels to the bit
            img = exact.gaussian_blur(img, self.policy.blur.kernel_size, d.blur)
            if tick is not None:
                tick(BLUR)
        return img

    def _color_image(self, img: Image.Image, d: SampleDraw, tick=None) -> Image.Image:
        """ColorJitter in its drawn order, then RandomGrayscale (torchvision's rgb_to_grayscale with 3
        channels on PIL: the L image in each channel)."""
        img = self._run_ops(img, d.jitter, self._pillow_op, tick)
        if d.grayscale:
            img = img.convert("L").convert("RGB")
            if tick is not None:
                tick(GRAYSCALE)
        return img

    def _color_array(self, arr: np.ndarray, d: SampleDraw, tick=None) -> np.ndarray:
        arr = self._run_ops(arr, d.jitter, self._array_op, tick)
        if d.grayscale:
            arr = fast.grayscale(arr)
            if tick is not None:
                tick(GRAYSCALE)
        return arr

    def augment_image(self, img: Image.Image, d: SampleDraw, tick=None) -> Image.Image:
        """The draw's ops (and an AugMix mixture) on an output-size image, exact mode's kernels: Pillow's,
        and for torchvision's AugMix torchvision's tensor ops (fusionflow/ops/augmix_torchvision.py)."""
        img = self._run_ops(img, d.ops, self._pillow_op, tick)
        if d.mix is not None and d.mix.style == "torchvision":  # its chains run on tensors: its tensor ops
            base = np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1))
            aug = self.policy.augment
            chain = lambda ops: augmix_torchvision.chain(base, ops, aug.interpolation, aug.augmix.fill)  # noqa: E731
            img = Image.fromarray(np.ascontiguousarray(augmix.tv_augmix(base, d.mix, chain).transpose(1, 2, 0)))
        elif d.mix is not None:
            base = img
            chain = lambda ops: np.asarray(self._run_ops(base, ops, self._pillow_op))  # noqa: E731
            img = Image.fromarray(augmix.augmix(np.asarray(base), d.mix, chain))
        if d.mix is not None and tick is not None:
            tick("augmix")
        return img

    def augment_array(self, arr: np.ndarray, d: SampleDraw, tick=None) -> np.ndarray:
        """The draw's ops (and an AugMix mixture) on an output-size uint8 HWC array, fast kernels."""
        arr = self._run_ops(arr, d.ops, self._array_op, tick)
        if d.mix is not None:
            base = arr
            arr = augmix.mix(base, d.mix, lambda ops: self._run_ops(base, ops, self._array_op))
            if tick is not None:
                tick("augmix")
        return arr

    def _style(self, op) -> exact.Style:
        if op.fill is not None:  # a per-op fill (DeepAA's cutout colour): one Style per (filter, fill)
            key = (op.resample or self.style.interpolation, op.fill)
            if key not in self._styles:
                self._styles[key] = exact.Style(*key)
            return self._styles[key]
        return self.style if op.resample is None else self._styles[op.resample]

    def _pillow_op(self, img, op, h, w):
        return exact.apply(op.name, img, op.value, op.params(h, w), self._style(op))

    def _array_op(self, arr, op, h, w):
        return self._kernels[op.name](arr, op.value, op.params(h, w), self._style(op))

    def _run_ops(self, img, ops, run_op, tick=None):
        h, w = self.policy.size
        for op in ops:
            img = run_op(img, op, h, w)
            if tick is not None:
                tick(op.name)
        return img

    def _boxed(self, data, d: SampleDraw, what) -> Image.Image:
        """The eval policy's Resize + CenterCrop and the keep_ratio crops (policy/keep_ratio.py) from the
        fractional box, then the keep_ratio pads (fast mode: eval has no ops, so its only saving would be the
        rounded crop, which moved 1-3 px patterns by half a pixel). Exact mode resizes the whole image first,
        as torchvision and timm do: their pixels to the bit, whatever the filter (a box's nearest or bicubic
        samples drifted by a source pixel or 21 levels)."""
        p = self.policy
        resample = exact.RESAMPLE[d.crop_resample or p.crop_interpolation]
        if not p.fast_downscale:
            return (self._keep_ratio_exact if p.keep_ratio is not None else self._center_exact)(data, what, d, resample)
        img, (_, _, pads) = decode_box_resize(
            data, partial(crop_plan, p, d), p.fast_downscale, what, p.max_pixels, resample
        )
        return img if not any(pads) else Image.fromarray(keep_ratio.pad(np.asarray(img), pads, p.keep_ratio.pad))

    def _trimmed(self, data, what) -> Image.Image:
        p = self.policy
        img = load_rgb(open_image(data, what, p.max_pixels), what)
        (ty, th), (tx, tw) = trim_side(p.trim, img.height), trim_side(p.trim, img.width)
        return img if (th, tw) == (img.height, img.width) else img.crop((tx, ty, tx + tw, ty + th))  # TrimBorder

    def _center_exact(self, data, what, d: SampleDraw, resample) -> Image.Image:
        p, img = self.policy, self._trimmed(data, what)
        (rh, rw), (top, left) = center_layout(p.center_resize, p.size, img.height, img.width)
        return img.resize((rw, rh), resample).crop((left, top, left + p.size[1], top + p.size[0]))

    def _keep_ratio_exact(self, data, what, d: SampleDraw, resample) -> Image.Image:
        p = self.policy
        img = self._trimmed(data, what)
        th, tw = img.height, img.width
        (rh, rw), (y0, y1, x0, x1), pads = keep_ratio.layout(p.keep_ratio, p.size, d.crop_u, th, tw)
        arr = np.asarray(img.resize((rw, rh), resample))[y0:y1, x0:x1]  # torchvision's F.resize on PIL
        return Image.fromarray(keep_ratio.pad(arr, pads, p.keep_ratio.pad))

    def _filtered(self, data, d: SampleDraw, what) -> Image.Image:
        """A random resized crop with bicubic or nearest: Pillow's filter on the full-scale window (the fast
        mode's kernels are bilinear ones); fast mode's bicubic on the DCT-scaled window (decode.py)."""
        p = self.policy
        resample = exact.RESAMPLE[d.crop_resample or p.crop_interpolation]
        window = partial(crop_window, p, d)
        return decode_crop_resize_filtered(data, window, p.size, resample, what, p.max_pixels, p.fast_downscale)

    def array(self, data, d: SampleDraw, what: str | None = None, tick=None, index: int | None = None) -> np.ndarray:
        """fast mode: the augmented sample as a uint8 HWC RGB array of the output size (through the
        decoded-image cache, when there is one, for sample `index`)."""
        cache = self.cache if index is not None else None
        arr = cache.kept_crop(index, d, data) if cache is not None else None  # refurbishing: the crop kept
        if arr is None:
            arr = self._from_cache(data, d, what, index) if cache is not None else None
            if arr is None:
                arr = self._cropped(data, d, what)
            if cache is not None:
                cache.keep_crop(index, d, data, arr)
        if tick is not None:
            tick("decode+crop+resize")
        if d.flip:
            arr = fast.flip(arr)
        if d.vflip:
            arr = fast.flip(arr, vertical=True)
        if tick is not None:
            tick("flip")
        after = self.policy.color_after_augment
        arr = arr if after else self._color_array(arr, d, tick)
        arr = self.augment_array(arr, d, tick)
        arr = self._color_array(arr, d, tick) if after else arr
        if d.blur is not None:
            arr = fast.gaussian_blur(arr, self.policy.blur.kernel_size, d.blur)
            if tick is not None:
                tick(BLUR)
        return arr

    def _cropped(self, data, d: SampleDraw, what) -> np.ndarray:
        """The uncached decode + crop + resize."""
        if self.policy.center_resize is not None or self.policy.keep_ratio is not None:
            return np.asarray(self._boxed(data, d, what))
        p, window = self.policy, partial(crop_window, self.policy, d)
        resample = d.crop_resample or p.crop_interpolation
        if resample == "bicubic" and (arr := fast_bicubic_array(data, window, p.size, what, p.max_pixels)) is not None:
            return arr  # timm's 'random' interpolation sends half the samples here
        if resample != "bilinear":
            return np.asarray(self._filtered(data, d, what))
        return decode_crop_resize_array(data, window, p.size, what, p.max_pixels)

    def _from_cache(self, data, d: SampleDraw, what, index: int) -> np.ndarray | None:
        """The decode, crop and resize from the cached image (fusionflow/ops/cached.py), or None."""
        t0 = time.perf_counter_ns()
        p = self.policy
        got = self.cache.source(data, index, what, p.max_pixels)
        if got is None:
            return None
        img, (height, width), hit = got
        resample, pads = d.crop_resample or p.crop_interpolation, None
        if p.center_resize is not None or p.keep_ratio is not None:
            box, covered, pads = crop_plan(p, d, height, width)
        else:
            (top, left, h, w), covered = crop_window(p, d, height, width), p.size
            box = (left, top, left + w, top + h)
        arr = crop_cached(img, (height, width), box, covered, resample)
        if pads is not None and any(pads):
            arr = keep_ratio.pad(arr, pads, p.keep_ratio.pad)
        if hit:
            self.cache.hit_time(time.perf_counter_ns() - t0)
        return arr

    def run_draw(
        self,
        data,
        d: SampleDraw,
        out: np.ndarray | None = None,
        what: str | None = None,
        tick=None,
        index: int | None = None,
    ) -> np.ndarray:
        if out is None:
            out = np.empty(self.out_shape, self.out_dtype)
        if self.authors_order:  # DeepAA in the authors' order: the whole image, exact kernels (ops/deepaa_order.py)
            self._write_image(authors_image(self.policy, data, d, what, self._style), out)
            if tick is not None:
                tick("decode+crop+resize")
        elif self.fast:
            self._write_array(self.array(data, d, what, tick, index), out)
        else:
            self._write_image(self.image(data, d, what, tick), out)
        if d.erase is not None:  # torchvision's / timm's erase on the output tensor: each rectangle := fill
            for (top, left, h, w), fill in zip(d.erase.rects, d.erase.fills(self.policy.erase)):
                out[:, top : top + h, left : left + w] = fill
        if tick is not None:
            tick("write")
        return out

    def _write_image(self, img: Image.Image, out: np.ndarray) -> None:
        if self.policy.normalize:
            np.multiply(np.asarray(img).transpose(2, 0, 1), self._scale, out=out, casting="unsafe")
            out += self._shift
        else:
            # Pillow's band split de-interleaves ~2x faster than a strided numpy transpose
            for plane, band in zip(out, img.split()):
                plane[...] = np.asarray(band)

    def _write_array(self, arr: np.ndarray, out: np.ndarray) -> None:
        if self.policy.normalize and out.dtype == np.float32 and out.flags.c_contiguous:
            for c, plane in enumerate(fast.split(arr)):  # (v / 255 - mean) / std, one pass per plane, in place
                cv2.addWeighted(plane, self._gain[c], plane, 0.0, self._bias[c], dst=out[c], dtype=cv2.CV_32F)
        elif self.policy.normalize:  # a caller's `out` of another dtype or layout
            for c, plane in enumerate(fast.split(arr)):
                np.multiply(plane, self._scale[c], out=out[c], casting="unsafe")
                out[c] += self._shift[c]
        elif out.flags.c_contiguous and out.dtype == np.uint8:
            fast.write_planes(arr, out)  # straight into the slot's planes
        else:
            np.copyto(out, arr.transpose(2, 0, 1), casting="unsafe")

    def __call__(
        self,
        data,
        index: int,
        seed: int = 0,
        epoch: int = 0,
        out: np.ndarray | None = None,
        what: str | None = None,
        tick=None,
        copy: int = 0,
    ) -> np.ndarray:
        """Augment sample `index` for (seed, epoch) into `out` (allocated if None); `copy` is the
        occurrence of `index` in the epoch (repeated augmentation, fusionflow.policy.sampling)."""
        return self.run_draw(
            data,
            draw(self.policy, seed, epoch, index, copy),
            out,
            what if what is not None else f"sample {index}",
            tick,
            index,
        )
