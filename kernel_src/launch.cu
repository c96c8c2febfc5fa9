// Launch settings shared by every CUDA launcher.
#include <stdlib.h>
#include <string.h>

#include "device_utils.cuh"

namespace ltx {

bool pdl_enabled() {
  static const bool enabled = [] {
    const char* env = getenv("LTX_KERNELS_PDL");
    return env == nullptr || strcmp(env, "0") != 0;
  }();
  return enabled;
}

}  // namespace ltx
