/* The names of the public enums' values, for messages: a config field that is
 * an enum is printed as its value's name (EPX_BFLOAT16), not as an integer. */
#ifndef EPX_CORE_NAMES_H
#define EPX_CORE_NAMES_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

/* The name of dtype (EPX_FLOAT32, ...), or NULL for a value outside the enum. */
const char *epx_dtype_name(epx_dtype_t dtype);

/* The name of `value` of the epx_buffer_config_t enum field `field` ("dtype",
 * "device", "exchange", "layout", "combine_precision", "exchange_path",
 * "fp8_format", "placement->replica_rule"), or NULL when the field is not one
 * of them or the value is outside its enum. */
const char *epx_config_enum_name(const char *field, int64_t value);

/* The value as text for a message: its name where `field` is an enum field
 * and the value one of its names, else the integer, written into buf. */
const char *epx_config_value_text(const char *field, int64_t value, char *buf, size_t size);

#endif
