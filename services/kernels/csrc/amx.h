// AMX tile helpers shared by ferry's CPU kernels (prefill_attention.cpp, tiled_linear.cpp).
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define FERRY_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

// Linux hands a process the AMX tile state only when asked, once (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); oneDNN asks too, but a kernel of ours may run first.
static inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
// Palette 1, the eight tiles each sixteen rows of 64 bytes (16 x 32 bfloat16, or 16 x 16 float32).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// One configuration for the process, held in static storage: built on the stack beside the
// caller's loop, GCC 12 dropped its stores of the column and row sizes (it does not see
// LDTILECFG read them), and the load then faulted on an all-zero shape.
static inline void amx_configure() {
  static const AmxTileConfig config = [] {
    AmxTileConfig c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
    return c;
  }();
  _tile_loadconfig(&config);
}
#else
#define FERRY_AMX 0
#endif
