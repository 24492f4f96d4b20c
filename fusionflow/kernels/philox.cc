// The per-sample uniforms of the augmentation draw (fusionflow/policy/sampling.py) for many samples in
// one call. Each sample's stream is numpy's Philox4x64-10 keyed by the seed with the counter
// (position, copy, index, epoch) -- what numpy.random.Philox produces when its state is set to that
// counter with an empty buffer: the counter's first word is incremented before each block of four
// 64-bit words, and Generator.random() maps a word w to (w >> 11) * 2^-53. The constants are those
// of the Philox paper (Salmon et al., SC'11: Random123's multipliers and Weyl key increments).
// Python reaches this through ctypes (fusionflow/policy/philox.py), which checks it against numpy.
#include <cstdint>

namespace {

constexpr uint64_t kMul0 = 0xD2E7470EE14C6C93ULL;
constexpr uint64_t kMul1 = 0xCA5A826395121157ULL;
constexpr uint64_t kWeyl0 = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kWeyl1 = 0xBB67AE8584CAA73BULL;
constexpr int kRounds = 10;
constexpr double kTwoToMinus53 = 1.0 / 9007199254740992.0;

inline void mul_wide(uint64_t a, uint64_t b, uint64_t* hi, uint64_t* lo) {
  unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  *hi = static_cast<uint64_t>(p >> 64);
  *lo = static_cast<uint64_t>(p);
}

// One block: four words from the counter c under the key (k0, k1).
inline void block(uint64_t c[4], uint64_t k0, uint64_t k1, uint64_t out[4]) {
  uint64_t x0 = c[0], x1 = c[1], x2 = c[2], x3 = c[3];
  for (int r = 0; r < kRounds; ++r) {
    if (r) {
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    uint64_t hi0, lo0, hi1, lo1;
    mul_wide(kMul0, x0, &hi0, &lo0);
    mul_wide(kMul1, x2, &hi1, &lo1);
    uint64_t y0 = hi1 ^ x1 ^ k0, y2 = hi0 ^ x3 ^ k1;
    x0 = y0;
    x1 = lo1;
    x2 = y2;
    x3 = lo0;
  }
  out[0] = x0;
  out[1] = x1;
  out[2] = x2;
  out[3] = x3;
}

}  // namespace

extern "C" {

// For each of n samples (indices[i], copies[i]) of `epoch` under the key (key0, key1): the uniforms
// `first` .. `first + count` of its stream (first a multiple of 4), row i of out (n x count doubles).
void ff_philox_uniforms(uint64_t key0, uint64_t key1, uint64_t epoch, const uint64_t* indices,
                        const uint64_t* copies, int64_t n, int64_t first, int64_t count, double* out) {
  for (int64_t i = 0; i < n; ++i) {
    double* row = out + i * count;
    uint64_t ctr[4] = {static_cast<uint64_t>(first / 4), copies[i], indices[i], epoch};
    uint64_t words[4];
    for (int64_t j = 0; j < count; j += 4) {
      if (++ctr[0] == 0 && ++ctr[1] == 0 && ++ctr[2] == 0) ++ctr[3];  // numpy's carry
      block(ctr, key0, key1, words);
      for (int w = 0; w < 4 && j + w < count; ++w) row[j + w] = static_cast<double>(words[w] >> 11) * kTwoToMinus53;
    }
  }
}

}  // extern "C"
