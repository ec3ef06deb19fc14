// NVFP4 KV-cache numerics by NVIDIA's own conversion code, compiled for the host: cuda_fp4.hpp's e2m1 and
// cuda_fp8.hpp's e4m3 conversions (their software paths, which state what the sm100 instructions
// cvt.rn.satfinite.e2m1x2.f32 and cvt.rn.satfinite.e4m3x2.f32 compute). tests/test_nvfp4_vendor.py compiles it
// against the headers in the venv and compares its bytes with fp8kv.nvfp4.
//
//   nvfp4_writes convert INPUTS OUTPUT        per float32 input, four bytes, each write's bytes in a row of its own:
//                                             __nv_cvt_float_to_fp4, __nv_fp4_e2m1(x), __nv_cvt_float_to_fp8
//                                             (satfinite, e4m3), __nv_fp8_e4m3(x)
//   nvfp4_writes decode OUTPUT                the 16 e2m1 codes as float32, by __nv_fp4_e2m1's float conversion
//   nvfp4_writes write INPUTS OUTPUT SCALE 6|4over6|flashinfer
//                                             vLLM's NVFP4 cache write of INPUTS (blocks of 16 float32 values) with
//                                             global scale SCALE, its reciprocals rounded to nearest, or FlashInfer's
//                                             (its divisions rounded to nearest): one e4m3 block scale byte per block,
//                                             then 8 packed bytes per block
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kBlock = 16;

float reciprocal(float x) { return 1.0f / x; }

uint8_t e2m1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }

float e2m1_value(float x) { return static_cast<float>(__nv_fp4_e2m1(x)); }

struct Candidate {
  uint8_t block_scale;
  float output_scale;
};

// cvt_warp_fp16_to_fp4's block scale and multiplier for a block whose largest magnitude maps to `target`.
Candidate candidate(float bmax, float global, float target) {
  const __nv_fp8_e4m3 block_scale(global * (bmax * reciprocal(target)));
  const float sf = static_cast<float>(block_scale);
  return {block_scale.__x, sf != 0.0f ? reciprocal(sf * reciprocal(global)) : 0.0f};
}

// nvfp4_reconstruction_error: neighbouring pairs summed, the pairs added in order.
float squared_error(const float* x, float output_scale) {
  const float read_back = output_scale != 0.0f ? reciprocal(output_scale) : 0.0f;
  float error = 0.0f;
  for (int i = 0; i < kBlock; i += 2) {
    const float dx = e2m1_value(x[i] * output_scale) * read_back - x[i];
    const float dy = e2m1_value(x[i + 1] * output_scale) * read_back - x[i + 1];
    error += dx * dx + dy * dy;
  }
  return error;
}

void write_block(const float* x, float global, bool four_over_six, uint8_t* block_scale, uint8_t* packed) {
  float bmax = 0.0f;
  for (int i = 0; i < kBlock; ++i) bmax = std::fmax(bmax, std::fabs(x[i]));
  Candidate chosen = candidate(bmax, global, 6.0f);
  if (four_over_six) {
    const Candidate four = candidate(bmax, global, 4.0f);
    if (squared_error(x, four.output_scale) < squared_error(x, chosen.output_scale)) chosen = four;
  }
  *block_scale = chosen.block_scale;
  for (int i = 0; i < kBlock; i += 2) {
    // float2 {x, y}: x (the even index) lands in the low nibble
    const float2 pair = make_float2(x[i] * chosen.output_scale, x[i + 1] * chosen.output_scale);
    packed[i / 2] = __nv_cvt_float2_to_fp4x2(pair, __NV_E2M1, cudaRoundNearest);
  }
}

// FlashInfer 0.7.0.post1's include/flashinfer/page.cuh, as read: nvfp4_append_quantize_e2m1, its own e2m1 rounding
// (a table of the midpoints), and nvfp4_append_quantize_block without precise_rounding (the slot-mapping writer's),
// the block scale by cuda_fp8.hpp's __nv_fp8_e4m3 constructor.
uint8_t flashinfer_e2m1(float value) {
  const uint8_t sign = std::signbit(value) ? 0x8 : 0x0;
  const float mag = std::fabs(value);
  uint8_t code;
  if (!(mag > 0.25f)) {
    code = 0;
  } else if (mag < 0.75f) {
    code = 1;
  } else if (mag <= 1.25f) {
    code = 2;
  } else if (mag < 1.75f) {
    code = 3;
  } else if (mag <= 2.5f) {
    code = 4;
  } else if (mag < 3.5f) {
    code = 5;
  } else if (mag <= 5.0f) {
    code = 6;
  } else {
    code = 7;
  }
  return sign | code;
}

void flashinfer_write_block(const float* x, float global_scale, uint8_t* block_scale, uint8_t* packed) {
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float sf_value = amax > 0.0f && global_scale > 0.0f ? amax / (6.0f * global_scale) : 0.0f;
  const __nv_fp8_e4m3 sf_fp8(sf_value);
  *block_scale = sf_fp8.__x;
  const float sf_rounded = static_cast<float>(sf_fp8);
  const float output_scale =
      amax > 0.0f && sf_rounded > 0.0f && global_scale > 0.0f ? 1.0f / (sf_rounded * global_scale) : 0.0f;
  for (int i = 0; i < kBlock; i += 2) {
    packed[i / 2] = flashinfer_e2m1(x[i] * output_scale) | (flashinfer_e2m1(x[i + 1] * output_scale) << 4);
  }
}

std::vector<float> read_floats(const char* path) {
  std::vector<float> values;
  std::FILE* in = std::fopen(path, "rb");
  if (in == nullptr) return values;
  float value;
  while (std::fread(&value, sizeof value, 1, in) == 1) values.push_back(value);
  std::fclose(in);
  return values;
}

int emit(const char* path, const std::vector<uint8_t>& bytes) {
  std::FILE* out = std::fopen(path, "wb");
  if (out == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), out) != bytes.size()) return 2;
  return std::fclose(out) == 0 ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "decode") == 0 && argc == 3) {
    std::vector<uint8_t> bytes;
    for (int code = 0; code < 16; ++code) {
      __nv_fp4_e2m1 value;
      value.__x = static_cast<__nv_fp4_storage_t>(code);
      const float f = static_cast<float>(value);
      const auto* raw = reinterpret_cast<const uint8_t*>(&f);
      bytes.insert(bytes.end(), raw, raw + sizeof f);
    }
    return emit(argv[2], bytes);
  }
  if (std::strcmp(mode, "convert") == 0 && argc == 4) {
    const std::vector<float> inputs = read_floats(argv[2]);
    const size_t n = inputs.size();
    std::vector<uint8_t> bytes(4 * n);
    for (size_t i = 0; i < n; ++i) {
      bytes[i] = e2m1(inputs[i]);
      bytes[n + i] = __nv_fp4_e2m1(inputs[i]).__x;
      bytes[2 * n + i] = __nv_cvt_float_to_fp8(inputs[i], __NV_SATFINITE, __NV_E4M3);
      bytes[3 * n + i] = __nv_fp8_e4m3(inputs[i]).__x;
    }
    return emit(argv[3], bytes);
  }
  if (std::strcmp(mode, "write") == 0 && argc == 6) {
    const std::vector<float> inputs = read_floats(argv[2]);
    const size_t blocks = inputs.size() / kBlock;
    const float scale = std::strtof(argv[4], nullptr);
    const float global = reciprocal(scale);  // vLLM's kernel: 1.0f / k_scale; FlashInfer's takes k_scale
    const bool four_over_six = std::strcmp(argv[5], "4over6") == 0;
    const bool flashinfer = std::strcmp(argv[5], "flashinfer") == 0;
    std::vector<uint8_t> bytes(blocks * (1 + kBlock / 2));
    for (size_t b = 0; b < blocks; ++b) {
      if (flashinfer) {
        flashinfer_write_block(&inputs[b * kBlock], scale, &bytes[b], &bytes[blocks + b * kBlock / 2]);
      } else {
        write_block(&inputs[b * kBlock], global, four_over_six, &bytes[b], &bytes[blocks + b * kBlock / 2]);
      }
    }
    return emit(argv[3], bytes);
  }
  std::fprintf(stderr,
               "usage: nvfp4_writes convert INPUTS OUTPUT | decode OUTPUT | write INPUTS OUTPUT SCALE "
               "6|4over6|flashinfer\n");
  return 2;
}
