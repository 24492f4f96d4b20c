// Decode only a window of a JPEG, optionally at a reduced DCT scale, with libjpeg-turbo.
//
// The CPU workers' random resized crop needs a window of the image at (or above) the output size.
// libjpeg-turbo can produce exactly that and nothing else: scale_num/scale_denom runs the inverse
// DCT at 1/2, 1/4 or 1/8 of the size (the same scaled IDCT Pillow's draft() uses),
// jpeg_skip_scanlines skips the rows above the window (entropy decoding only, no IDCT or colour
// conversion), jpeg_crop_scanline limits IDCT, upsampling and colour conversion to the window's
// iMCU columns, and decoding stops after the window's last row. At scale 1 the window's pixels
// are those of a full decode (same IDCT, same fancy upsampling), so the exact mode can use it too.
//
// Errors never exit the process: libjpeg's error_exit longjmps back here. Any warning (a
// truncated or corrupt stream that libjpeg would paper over with grey) is reported as a failure,
// so the caller falls back to Pillow, which raises its usual, sample-naming error.
#include <csetjmp>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <new>

#include <jpeglib.h>

namespace {

struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  bool warned;
};

void on_error(j_common_ptr cinfo) {
  std::longjmp(reinterpret_cast<ErrorManager*>(cinfo->err)->jump, 1);
}

void on_message(j_common_ptr cinfo, int msg_level) {
  if (msg_level < 0) reinterpret_cast<ErrorManager*>(cinfo->err)->warned = true;  // corrupt data
}

void put_error(j_decompress_ptr cinfo, char* err, int errlen) {
  if (err && errlen > 0) (*cinfo->err->format_message)(reinterpret_cast<j_common_ptr>(cinfo), err);
}

void put_text(const char* text, char* err, int errlen) {
  if (err && errlen > 0) std::snprintf(err, static_cast<size_t>(errlen), "%s", text);
}

// Errors longjmp back to the caller's setjmp (which must be in the calling function's own frame),
// warnings are remembered.
void attach_errors(jpeg_decompress_struct* cinfo, ErrorManager* jerr) {
  cinfo->err = jpeg_std_error(&jerr->pub);
  jerr->pub.error_exit = on_error;
  jerr->pub.emit_message = on_message;
  jerr->warned = false;
}

}  // namespace

extern "C" {

// Header only: dims[0] = height, dims[1] = width, dims[2] = components. Returns 0, or -1 with err.
int ff_jpeg_info(const unsigned char* data, unsigned long size, int* dims, char* err, int errlen) {
  jpeg_decompress_struct cinfo;
  ErrorManager jerr;
  attach_errors(&cinfo, &jerr);
  if (setjmp(jerr.jump)) {
    put_error(&cinfo, err, errlen);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, size);
  jpeg_read_header(&cinfo, TRUE);
  dims[0] = static_cast<int>(cinfo.image_height);
  dims[1] = static_cast<int>(cinfo.image_width);
  dims[2] = cinfo.num_components;
  jpeg_destroy_decompress(&cinfo);
  return 0;
}

// SOI first and EOI last, up to trailing padding (NUL, CR, LF, space) in the last 16 bytes: the same test as
// fusionflow/ops/jpeg.py's is_complete_jpeg (a truncated file is left to Pillow, which names the fault).
static bool complete_jpeg(const unsigned char* data, unsigned long size) {
  if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) return false;
  unsigned long lower = size > 16 ? size - 16 : 0, end = size;
  while (end > lower && (data[end - 1] == 0 || data[end - 1] == '\r' || data[end - 1] == '\n' || data[end - 1] == ' '))
    --end;
  return end - lower >= 2 && data[end - 2] == 0xFF && data[end - 1] == 0xD9;
}

// One header into hw[0..1] with a decompressor made once for many (aborted after each header); the
// setjmp lives in this frame, so an error in one image returns here and the next image goes on.
static bool header_into(jpeg_decompress_struct* cinfo, ErrorManager* jerr, const unsigned char* data,
                        unsigned long size, int* hw) {
  if (setjmp(jerr->jump)) {
    jpeg_abort_decompress(cinfo);
    return false;
  }
  jpeg_mem_src(cinfo, data, size);
  jpeg_read_header(cinfo, TRUE);
  const bool plain = cinfo->num_components == 1 || cinfo->num_components == 3;  // not CMYK / YCCK
  hw[0] = plain ? static_cast<int>(cinfo->image_height) : 0;
  hw[1] = plain ? static_cast<int>(cinfo->image_width) : 0;
  jpeg_abort_decompress(cinfo);
  return plain;
}

// A run of headers in one call: hw[2k], hw[2k + 1] = height, width of image k, or 0, 0 where it is not a
// complete JPEG, its header cannot be read, or it has neither 1 nor 3 components (CMYK, YCCK) (the caller reads
// those another way). Returns how many were read.
int ff_jpeg_info_many(const unsigned char* const* data, const unsigned long* sizes, int n, int* hw) {
  jpeg_decompress_struct cinfo;
  ErrorManager jerr;
  attach_errors(&cinfo, &jerr);
  if (setjmp(jerr.jump)) {  // creating the decompressor failed (out of memory): nothing read
    std::memset(hw, 0, sizeof(int) * 2 * static_cast<size_t>(n));
    return 0;
  }
  jpeg_create_decompress(&cinfo);
  int read = 0;
  for (int k = 0; k < n; ++k) {
    hw[2 * k] = hw[2 * k + 1] = 0;
    const unsigned char* image = data[k];
    if (image != nullptr && complete_jpeg(image, sizes[k]) && header_into(&cinfo, &jerr, image, sizes[k], hw + 2 * k))
      ++read;
  }
  // jerr.jump still names header_into's finished frame: safe only because destroying raises no error
  jpeg_destroy_decompress(&cinfo);
  return read;
}

// Whether the FF D9 at s[p] ends the image (s: the data after the first scan header, m bytes): what follows is
// under two bytes or a next frame (FF D8: an MPO's), or does not itself end in FF D9 (a trailer). Random bytes in
// place of a scan hold an FF D9 about once in 190 bytes, before the real end.
static bool image_ends_at(const unsigned char* s, unsigned long m, unsigned long p) {
  unsigned long rest = m - (p + 2);
  if (rest < 2)
    return true;
  if (s[p + 2] == 0xFF && s[p + 3] == 0xD8)
    return true;
  return !(s[m - 2] == 0xFF && s[m - 1] == 0xD9);
}

// 1 when no FF followed by 01..BF (a marker that exists nowhere) lies between a JPEG's first scan header and its
// end; 0 when one does, or when the header's segments cannot be walked to the scan. Python's reference:
// accel/header_sizes.py scan_is_clean (the same rules, one memchr per FF byte instead of whole-array passes).
static int scan_clean(const unsigned char* d, unsigned long n) {
  unsigned long pos = 2;
  for (;;) {  // the header's segments, by their lengths, up to and over the first SOS
    if (pos + 4 > n || d[pos] != 0xFF)
      return 0;
    if (d[pos + 1] == 0xFF) {  // a fill byte
      pos += 1;
      continue;
    }
    unsigned char marker = d[pos + 1];
    pos += 2 + ((static_cast<unsigned long>(d[pos + 2]) << 8) | d[pos + 3]);
    if (marker == 0xDA)
      break;
  }
  if (pos + 2 > n)
    return 1;  // nothing after the scan header to hold a marker
  const unsigned char* s = d + pos;
  unsigned long m = n - pos;
  bool first_end = true;  // only the first FF D9 may end the image early (the Python reference's rule)
  for (unsigned long i = 0; i + 1 < m;) {
    const void* hit = std::memchr(s + i, 0xFF, m - 1 - i);
    if (hit == nullptr)
      break;
    i = static_cast<unsigned long>(static_cast<const unsigned char*>(hit) - s);
    unsigned char after = s[i + 1];
    if (after == 0xD9 && first_end) {
      first_end = false;
      if (image_ends_at(s, m, i))
        return 1;
    } else if (after >= 0x01 && after <= 0xBF) {
      return 0;
    }
    i += 1;
  }
  return 1;
}

// scan_clean of each of n JPEGs into clean[k]. Returns how many are clean.
int ff_jpeg_scan_clean_many(const unsigned char* const* data, const unsigned long* sizes, int n, int* clean) {
  int count = 0;
  for (int k = 0; k < n; ++k) {
    clean[k] = data[k] != nullptr && scan_clean(data[k], sizes[k]);
    count += clean[k];
  }
  return count;
}

// Decode rows [top, top + height) and columns [left, left + width) of the image scaled by
// scale_num/scale_denom (libjpeg-turbo: M/8, M = 1..16; coordinates in the scaled image) as RGB into `out`,
// row-major with `out_stride` bytes per row, at most `out_rows` rows of `out_stride / 3` pixels.
// The window is clipped to the reduced image. On success returns 0 and sets
// dims = {scaled image height, scaled image width, rows written, columns written}.
// Returns -1 with a message in err on any error or warning; -2 if the colour space is not one
// this decoder turns into RGB exactly as Pillow does (CMYK, YCCK): use Pillow for those.
int ff_jpeg_decode_window(const unsigned char* data, unsigned long size, int scale_num, int scale_denom, int top,
                          int left, int height, int width, unsigned char* out, int out_stride,
                          int out_rows, int* dims, char* err, int errlen) {
  jpeg_decompress_struct cinfo;
  ErrorManager jerr;
  attach_errors(&cinfo, &jerr);
  unsigned char* volatile row_buf = nullptr;  // volatile: read after longjmp
  if (setjmp(jerr.jump)) {
    put_error(&cinfo, err, errlen);
    jpeg_destroy_decompress(&cinfo);
    delete[] row_buf;
    return -1;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, size);
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK ||
      (cinfo.num_components != 1 && cinfo.num_components != 3)) {
    put_text("colour space not decoded here (CMYK/YCCK)", err, errlen);
    jpeg_destroy_decompress(&cinfo);
    return -2;
  }
  cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = static_cast<unsigned int>(scale_num);
  cinfo.scale_denom = static_cast<unsigned int>(scale_denom);
  cinfo.dct_method = JDCT_ISLOW;  // libjpeg's and Pillow's default
  jpeg_start_decompress(&cinfo);
  const int full_h = static_cast<int>(cinfo.output_height);
  const int full_w = static_cast<int>(cinfo.output_width);
  int x0 = left < 0 ? 0 : left, y0 = top < 0 ? 0 : top;
  int x1 = left + width > full_w ? full_w : left + width;
  int y1 = top + height > full_h ? full_h : top + height;
  if (x1 <= x0 || y1 <= y0 || y1 - y0 > out_rows || (x1 - x0) * 3 > out_stride) {
    put_text("window outside the image or larger than the output buffer", err, errlen);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  // crop_scanline widens the window to iMCU boundaries and upsamples chroma at the widened
  // window's edges from replicated samples, not the neighbours a full decode uses; a margin of
  // one iMCU (16 px at most) on each side keeps those edges out of what we copy.
  const int xm0 = x0 - 16 < 0 ? 0 : x0 - 16, xm1 = x1 + 16 > full_w ? full_w : x1 + 16;
  JDIMENSION xoff = static_cast<JDIMENSION>(xm0), cw = static_cast<JDIMENSION>(xm1 - xm0);
  if (cw < static_cast<JDIMENSION>(full_w)) jpeg_crop_scanline(&cinfo, &xoff, &cw);
  else xoff = 0;
  const int skip_cols = x0 - static_cast<int>(xoff);
  row_buf = new (std::nothrow) unsigned char[static_cast<size_t>(cinfo.output_width) * 3];
  if (row_buf == nullptr) {  // never throw across the C boundary
    put_text("out of memory for a scanline", err, errlen);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  if (y0 > 0) jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(y0));
  const size_t row_bytes = static_cast<size_t>(x1 - x0) * 3;
  for (int y = y0; y < y1; ++y) {
    JSAMPROW rows[1] = {row_buf};
    if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
      put_text("fewer scanlines than the header promises", err, errlen);
      jpeg_destroy_decompress(&cinfo);
      delete[] row_buf;
      return -1;
    }
    std::memcpy(out + static_cast<size_t>(y - y0) * static_cast<size_t>(out_stride),
                row_buf + static_cast<size_t>(skip_cols) * 3, row_bytes);
  }
  delete[] row_buf;
  row_buf = nullptr;
  const bool warned = jerr.warned;
  jpeg_destroy_decompress(&cinfo);  // rows below the window are never decoded
  if (warned) {
    put_text("corrupt JPEG data (libjpeg warning)", err, errlen);
    return -1;
  }
  dims[0] = full_h;
  dims[1] = full_w;
  dims[2] = y1 - y0;
  dims[3] = x1 - x0;
  return 0;
}

}  // extern "C"
