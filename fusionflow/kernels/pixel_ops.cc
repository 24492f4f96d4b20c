// Per-sample pixel kernels of the CPU pipeline's fast mode, where no library call is fast on
// 224x224 interleaved RGB (experiments/bench_ops.py measured each against Pillow and OpenCV):
//
//   ff_affine_nearest   the geometric ops (ShearX, ShearY, Rotate) with nearest sampling. Pillow's
//                       own transform is fast on its 4-byte pixels, but an array pays two 3 <-> 4
//                       byte conversions around it, and OpenCV's warpAffine builds a float map
//                       first. This walks Pillow's 16.16 fixed-point source coordinates (the rule
//                       Pillow applies whenever the image corners fit in +-32768, always at our
//                       sizes), so its pixels are Pillow's, bit for bit.
//   ff_equalize         ImageOps.equalize and ImageOps.autocontrast (no cutoff): one pass for the
//   ff_autocontrast     three histograms, Pillow's per-band tables, one pass through them, in
//                       place of a split, three histograms, three lookups and a merge.
//
// Images are C-contiguous uint8 HxWx3. Nothing here allocates or keeps state; every function
// returns 0, or 1 when it declines (the caller then runs its library kernel).
#include <cstdint>
#include <cstring>

namespace {

constexpr double kFixedLimit = 32768.0;

bool fits_fixed(const double* m, double x, double y) {
  double u = x * m[0] + y * m[1] + m[2], v = x * m[3] + y * m[4] + m[5];
  return u < kFixedLimit && u > -kFixedLimit && v < kFixedLimit && v > -kFixedLimit;
}

int32_t to_fixed(double v) {  // v * 2^16 rounded half up (floor of v * 2^16 + 0.5)
  double s = v * 65536.0 + 0.5;
  int32_t t = static_cast<int32_t>(s);
  return (s < 0.0 && static_cast<double>(t) != s) ? t - 1 : t;
}

void histograms(const uint8_t* src, int64_t npix, int64_t hist[3][256]) {
  // Two interleaved sets per channel so that neighbouring pixels of equal value do not wait on one
  // another's increment.
  uint32_t a[3][256] = {}, b[3][256] = {};
  int64_t i = 0;
  for (; i + 1 < npix; i += 2) {
    const uint8_t* p = src + 3 * i;
    ++a[0][p[0]], ++a[1][p[1]], ++a[2][p[2]];
    ++b[0][p[3]], ++b[1][p[4]], ++b[2][p[5]];
  }
  if (i < npix) {
    const uint8_t* p = src + 3 * i;
    ++a[0][p[0]], ++a[1][p[1]], ++a[2][p[2]];
  }
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v) hist[c][v] = static_cast<int64_t>(a[c][v]) + b[c][v];
}

// Each channel's lowest and highest value (255 and 0 for no pixels): 48-byte blocks (16 pixels)
// min/maxed lane by lane, which compilers vectorise, then lane j folded into channel j % 3.
void channel_ranges(const uint8_t* __restrict src, int64_t npix, int lows[3], int highs[3]) {
  uint8_t mn[48], mx[48];
  std::memset(mn, 255, sizeof mn);
  std::memset(mx, 0, sizeof mx);
  const int64_t n = 3 * npix;
  int64_t i = 0;
  for (; i + 48 <= n; i += 48)
    for (int j = 0; j < 48; ++j) {
      const uint8_t v = src[i + j];
      mn[j] = v < mn[j] ? v : mn[j];
      mx[j] = v > mx[j] ? v : mx[j];
    }
  for (int j = 0; i + j < n; ++j) {
    const uint8_t v = src[i + j];
    mn[j] = v < mn[j] ? v : mn[j];
    mx[j] = v > mx[j] ? v : mx[j];
  }
  for (int c = 0; c < 3; ++c) {
    lows[c] = 255, highs[c] = 0;
    for (int j = c; j < 48; j += 3) {
      lows[c] = mn[j] < lows[c] ? mn[j] : lows[c];
      highs[c] = mx[j] > highs[c] ? mx[j] : highs[c];
    }
  }
}

uint8_t clip8(int64_t v) { return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v)); }

void apply_tables(const uint8_t* __restrict src, uint8_t* __restrict dst, int64_t npix, const uint8_t lut[3][256]) {
  const int64_t n = 3 * npix;
  int64_t i = 0;
  for (; i + 6 <= n; i += 6) {  // two pixels a step: the loads of one overlap the other's lookups
    dst[i] = lut[0][src[i]], dst[i + 1] = lut[1][src[i + 1]], dst[i + 2] = lut[2][src[i + 2]];
    dst[i + 3] = lut[0][src[i + 3]], dst[i + 4] = lut[1][src[i + 4]], dst[i + 5] = lut[2][src[i + 5]];
  }
  for (; i < n; i += 3) dst[i] = lut[0][src[i]], dst[i + 1] = lut[1][src[i + 1]], dst[i + 2] = lut[2][src[i + 2]];
}

}  // namespace

extern "C" {

// dst (oh x ow x 3) = src (h x w x 3) sampled at Pillow's affine data m (output pixel centre ->
// input coordinates), nearest; pixels whose source falls outside src take `fill`.
int ff_affine_nearest(const uint8_t* src, int h, int w, uint8_t* dst, int oh, int ow, const double* m,
                      const uint8_t* fill) {
  if (!(fits_fixed(m, 0, 0) && fits_fixed(m, ow, oh) && fits_fixed(m, 0, oh) && fits_fixed(m, ow, 0))) return 1;
  const int32_t dx = to_fixed(m[0]), dy_row = to_fixed(m[1]);
  const int32_t ex = to_fixed(m[3]), ey_row = to_fixed(m[4]);
  int32_t x_row = to_fixed(m[2] + m[0] * 0.5 + m[1] * 0.5);
  int32_t y_row = to_fixed(m[5] + m[3] * 0.5 + m[4] * 0.5);
  const int64_t row_bytes = static_cast<int64_t>(w) * 3;
  for (int y = 0; y < oh; ++y) {
    uint8_t* out = dst + static_cast<int64_t>(y) * ow * 3;
    // The source position is linear along the row, so the pixels whose source lies inside the
    // image form one run: find its ends, fill outside it, copy inside it without bounds checks.
    // (Accumulating in 32 bits as Pillow does; the corner check keeps every value in range.)
    auto inside = [&](int x) {  // 64-bit: x * dx alone may leave the 32-bit range the sum stays in
      const int64_t xi = (static_cast<int64_t>(x_row) + static_cast<int64_t>(x) * dx) >> 16;
      const int64_t yi = (static_cast<int64_t>(y_row) + static_cast<int64_t>(x) * ex) >> 16;
      return xi >= 0 && xi < w && yi >= 0 && yi < h;
    };
    int lo = 0, hi = ow;
    while (lo < ow && !inside(lo)) ++lo;
    while (hi > lo && !inside(hi - 1)) --hi;
    for (int x = 0; x < lo; ++x) std::memcpy(out + 3 * x, fill, 3);
    for (int x = hi; x < ow; ++x) std::memcpy(out + 3 * x, fill, 3);
    int32_t xx = static_cast<int32_t>(x_row + static_cast<int64_t>(lo) * dx);  // inside the image: in range
    int32_t yy = static_cast<int32_t>(y_row + static_cast<int64_t>(lo) * ex);
    uint8_t* __restrict o = out + 3 * lo;
    // Four-byte moves: each writes one byte past its pixel, which the next pixel overwrites; the
    // run's last pixel moves three bytes (it may end the row or the buffer), and so does a source
    // pixel at the very end of the image.
    const uint8_t* const last_src = src + (static_cast<int64_t>(h) * w - 1) * 3;
    for (int x = lo; x < hi - 1; ++x, o += 3, xx += dx, yy += ex) {
      const uint8_t* p = src + (yy >> 16) * row_bytes + (xx >> 16) * 3;
      if (p == last_src) {
        o[0] = p[0], o[1] = p[1], o[2] = p[2];
      } else {
        uint32_t v;
        std::memcpy(&v, p, 4);
        std::memcpy(o, &v, 4);
      }
    }
    if (lo < hi) {
      const uint8_t* p = src + (yy >> 16) * row_bytes + (xx >> 16) * 3;
      o[0] = p[0], o[1] = p[1], o[2] = p[2];
    }
    x_row += dy_row;
    y_row += ey_row;
  }
  return 0;
}

// ImageOps.equalize: per band, with step = (pixels - count of the highest present value) // 255,
// value v maps to (step // 2 + pixels below v) // step (clipped to 255); a band with one present
// value, or a step of 0, is left as it is.
int ff_equalize(const uint8_t* src, uint8_t* dst, int64_t npix) {
  int64_t hist[3][256];
  histograms(src, npix, hist);
  uint8_t lut[3][256];
  for (int c = 0; c < 3; ++c) {
    int64_t total = 0, last = 0;
    int present = 0;
    for (int v = 0; v < 256; ++v)
      if (hist[c][v]) total += hist[c][v], last = hist[c][v], ++present;
    const int64_t step = present > 1 ? (total - last) / 255 : 0;
    int64_t below = 0;
    for (int v = 0; v < 256; ++v) {
      lut[c][v] = step ? clip8((step / 2 + below) / step) : static_cast<uint8_t>(v);
      below += hist[c][v];
    }
  }
  apply_tables(src, dst, npix, lut);
  return 0;
}

// ImageOps.autocontrast without cutoff: per band, [lowest, highest] value stretched to 0..255 with Pillow's float64 arithmetic, truncated and clipped; a band of one value is left.
int ff_autocontrast(const uint8_t* src, uint8_t* dst, int64_t npix) {
  int lows[3], highs[3];
  channel_ranges(src, npix, lows, highs);
  uint8_t lut[3][256];
  for (int c = 0; c < 3; ++c) {
    const int lo = lows[c], hi = highs[c];
    if (hi <= lo) {
      for (int v = 0; v < 256; ++v) lut[c][v] = static_cast<uint8_t>(v);
      continue;
    }
    const double scale = 255.0 / (hi - lo), offset = -lo * scale;
    for (int v = 0; v < 256; ++v) {
      const double s = v * scale + offset;
      lut[c][v] = clip8(static_cast<int64_t>(s));  // truncation toward zero, as int() in Python
    }
  }
  apply_tables(src, dst, npix, lut);
  return 0;
}

}  // extern "C"
