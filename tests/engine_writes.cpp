// The fp8 KV-cache writes of CUDA engines, computed by the vendors' own conversion code on the host:
// NVIDIA's cuda_fp8.hpp (its software path is what pre-sm89 GPUs run, and it emulates the
// cvt.rn.satfinite instruction that sm89+ GPUs and Triton's fp8 stores use) and PyTorch's c10 headers
// (the scalar conversions torch's CUDA kernels call). tests/test_engine_writes_vendor.py compiles it
// against the headers installed in the venv and compares its bytes with fp8kv's engine models.
//
//   engine_writes MODE INPUTS OUTPUT SCALE...
//
// MODE is the activation dtype, bf16, f16 or f32; INPUTS holds float32 values (exact bf16 or fp16 values
// in those modes); OUTPUT receives, for each SCALE in order, one byte per input for each write below, in order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// vLLM CUDA's scaled_vec_conversion: __nv_cvt_float_to_fp8(float(a) / scale, __NV_SATFINITE, fp8_type).
uint8_t vllm_cuda(float x, float scale, __nv_fp8_interpretation_t format) {
  return __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, format);
}

// SGLang: cache_k.div_(k_scale), then cache_k.to(fp8). A bf16 (fp16) tensor divided by a 0-dim float32
// CUDA tensor runs DivFunctor<BFloat16> (<Half>): both operands in that type, the quotient rounded to it.
// The cast is c10's constructor, which torch's CUDA copy kernel calls for each element: torch 2.11's, the
// version SGLang pins, converts as the installed torch 2.9's headers do (NaN past the range).
template <typename Activation, typename Fp8>
uint8_t sglang_16bit(float x, float scale) {
  Activation quotient = Activation(x) / Activation(scale);
  return Fp8(static_cast<float>(quotient)).x;
}

template <typename Fp8>
uint8_t sglang_f32(float x, float scale) {
  return Fp8(x / scale).x;
}

// TensorRT-LLM: x * kv_scale_orig_quant with the reciprocal held in bf16 (fp16), then __nv_fp8_e4m3's
// conversion.
uint8_t tensorrt_llm_bf16(float x, float scale) {
  __nv_bfloat16 reciprocal = __float2bfloat16(1.0f / scale);
  __nv_bfloat16 product = __hmul(__float2bfloat16(x), reciprocal);
  return __nv_fp8_e4m3(product).__x;
}

uint8_t tensorrt_llm_f16(float x, float scale) {
  __half reciprocal = __float2half(1.0f / scale);
  __half product = __hmul(__float2half(x), reciprocal);
  return __nv_fp8_e4m3(product).__x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: engine_writes bf16|f16|f32 INPUTS OUTPUT SCALE...\n");
    return 2;
  }
  const bool bf16 = std::strcmp(argv[1], "bf16") == 0, f16 = std::strcmp(argv[1], "f16") == 0;
  std::FILE* in = std::fopen(argv[2], "rb");
  std::FILE* out = std::fopen(argv[3], "wb");
  if (in == nullptr || out == nullptr) {
    std::perror("engine_writes");
    return 2;
  }
  std::vector<float> inputs;
  float value;
  while (std::fread(&value, sizeof value, 1, in) == 1) {
    inputs.push_back(value);
  }
  std::vector<uint8_t> bytes(inputs.size());
  for (int arg = 4; arg < argc; ++arg) {
    const float scale = std::strtof(argv[arg], nullptr);
    auto emit = [&](auto write) {
      for (size_t i = 0; i < inputs.size(); ++i) bytes[i] = write(inputs[i]);
      std::fwrite(bytes.data(), 1, bytes.size(), out);
    };
    emit([&](float x) { return vllm_cuda(x, scale, __NV_E4M3); });
    emit([&](float x) { return vllm_cuda(x, scale, __NV_E5M2); });
    if (bf16) {
      emit([&](float x) { return sglang_16bit<c10::BFloat16, c10::Float8_e4m3fn>(x, scale); });
      emit([&](float x) { return sglang_16bit<c10::BFloat16, c10::Float8_e5m2>(x, scale); });
      emit([&](float x) { return tensorrt_llm_bf16(x, scale); });
    } else if (f16) {
      emit([&](float x) { return sglang_16bit<c10::Half, c10::Float8_e4m3fn>(x, scale); });
      emit([&](float x) { return sglang_16bit<c10::Half, c10::Float8_e5m2>(x, scale); });
      emit([&](float x) { return tensorrt_llm_f16(x, scale); });
    } else {
      emit([&](float x) { return sglang_f32<c10::Float8_e4m3fn>(x, scale); });
      emit([&](float x) { return sglang_f32<c10::Float8_e5m2>(x, scale); });
    }
  }
  return std::fclose(out) == 0 ? 0 : 2;
}
