#!/bin/sh
# Usage: library_self_contained.sh LIBRARY
# Fails when the shared library uses an epx_ symbol it does not define: a
# call into a module left out of that build (the fused exchange without
# NCCL's device API, say) would otherwise only fail when a program links it.
undefined=$(nm -D --undefined-only "$1" | grep -E ' epx_')
if [ -n "$undefined" ]; then
  echo "$1 uses epx_ symbols it does not define (guard the call by the module's EPX_HAVE_ macro):"
  echo "$undefined"
  exit 1
fi
echo "$1: every epx_ symbol it uses is defined"
