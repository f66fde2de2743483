#!/bin/sh
# Includes only point down (README, "What may include what"): src/core
# includes core only, src/cpu, src/cuda and src/comm include core and their
# own folder only; src/api may include every layer. Usage:
# include_direction.sh SRC_DIR. Exit 1 naming each include that points up
# or sideways.
src=${1:?usage: include_direction.sh SRC_DIR}
bad=0
for layer in core cpu cuda comm; do
  allowed="core"
  [ "$layer" != core ] && allowed="core|$layer"
  hits=$(find "$src/$layer" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) \
           -exec grep -HnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"(api|core|cpu|cuda|comm)/' {} + |
         grep -vE "#[[:space:]]*include[[:space:]]*\"($allowed)/")
  if [ -n "$hits" ]; then
    echo "src/$layer may include $(echo "$allowed" | tr '|' ' ') only:"
    echo "$hits"
    bad=1
  fi
done
[ $bad = 0 ] && echo "includes point down"
exit $bad
