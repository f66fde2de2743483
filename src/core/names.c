/* The public enums' value names (core/names.h), in the order of their values
 * in epx.h. */
#include "core/names.h"

#include <stdio.h>
#include <string.h>

static const char *const dtype_names[] = {"EPX_FLOAT32", "EPX_BFLOAT16", "EPX_FLOAT16"};
static const char *const device_names[] = {"EPX_DEVICE_CPU", "EPX_DEVICE_CUDA"};
static const char *const exchange_names[] = {"EPX_EXCHANGE_DEDUP", "EPX_EXCHANGE_COLLECTIVE",
                                             "EPX_EXCHANGE_HIERARCHICAL", "EPX_EXCHANGE_AUTO"};
static const char *const layout_names[] = {"EPX_LAYOUT_EXPERT_MAJOR", "EPX_LAYOUT_RANK_MAJOR",
                                           "EPX_LAYOUT_CAPACITY"};
static const char *const precision_names[] = {"EPX_COMBINE_PARTIALS_FLOAT32",
                                              "EPX_COMBINE_PARTIALS_PAYLOAD"};
static const char *const path_names[] = {"EPX_PATH_AUTO", "EPX_PATH_HOST", "EPX_PATH_FUSED"};
static const char *const fp8_names[] = {"EPX_FP8_NONE", "EPX_FP8_E4M3_F32_128",
                                        "EPX_FP8_E4M3_UE8M0_128", "EPX_FP8_MXFP8"};
static const char *const replica_names[] = {"EPX_REPLICA_ROUND_ROBIN", "EPX_REPLICA_CALLER"};

typedef struct {
  const char *field;
  const char *const *names;
  int64_t count;
} enum_names_t;

#define NAMES(field, names) {field, names, (int64_t)(sizeof names / sizeof *names)}
static const enum_names_t config_enums[] = {
    NAMES("dtype", dtype_names),         NAMES("device", device_names),
    NAMES("exchange", exchange_names),   NAMES("layout", layout_names),
    NAMES("combine_precision", precision_names), NAMES("exchange_path", path_names),
    NAMES("fp8_format", fp8_names),      NAMES("placement->replica_rule", replica_names)};
#undef NAMES

const char *epx_dtype_name(epx_dtype_t dtype) { return epx_config_enum_name("dtype", (int64_t)dtype); }

const char *epx_config_enum_name(const char *field, int64_t value) {
  for (size_t i = 0; i < sizeof config_enums / sizeof *config_enums; i++)
    if (!strcmp(field, config_enums[i].field))
      return value >= 0 && value < config_enums[i].count ? config_enums[i].names[value] : NULL;
  return NULL;
}

const char *epx_config_value_text(const char *field, int64_t value, char *buf, size_t size) {
  const char *name = epx_config_enum_name(field, value);
  if (name) return name;
  snprintf(buf, size, "%lld", (long long)value);
  return buf;
}
