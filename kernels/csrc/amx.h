// Whether this build and this process may use AMX's tiles (PAGEDSERVE_AMX, amx_usable()).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_AMX 1
#endif

namespace pagedserve {

#ifdef PAGEDSERVE_AMX
// Linux gives a process the tiles' state only once it asks (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel
// that refuses leaves the vdpbf16ps paths.
inline bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return usable;
}
#else
inline bool amx_usable() { return false; }
#endif

}  // namespace pagedserve
