/* The process-wide launch choices (common/launch_flags.h). */
#include "cuda/common/launch_flags.h"

#include <stdatomic.h>

static atomic_int g_launch_flags = EPX_CUDA_LAUNCH_DEFAULT;

void epx_cuda_set_launch_flags(int flags) { atomic_store_explicit(&g_launch_flags, flags, memory_order_relaxed); }

int epx_cuda_launch_flags(void) { return atomic_load_explicit(&g_launch_flags, memory_order_relaxed); }
