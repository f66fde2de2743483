/* The public buffer calls: create (the ranks agree one config), destroy,
 * the size queries and the stream. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "api/backends.h"
#include "api/ll.h"
#include "core/backend.h"
#include "core/checked.h"
#include "core/config.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/names.h"
#include "core/objects.h"
#include "core/placement.h"
#include "core/registry.h"
#include "core/route_spec.h"
#include "core/transport.h"

epx_status_t epx_check_comm(epx_comm_t *comm, const char *caller) {
  epx_comm_t object = epx_registry_get(*comm, EPX_OBJECT_COMM);
  if (!object)
    return epx_error(*comm ? EPX_ERROR_INVALID_HANDLE : EPX_ERROR_INVALID_ARGUMENT,
                     "%s: comm is %s; pass a comm from epx_comm_create_*", caller,
                     *comm ? "not a live comm (destroyed?)" : "NULL");
  *comm = object;
  return EPX_SUCCESS;
}

epx_status_t epx_check_buffer(epx_buffer_t *buffer, const char *caller) {
  if (!*buffer)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: buffer is NULL; pass a buffer from epx_buffer_create", caller);
  epx_buffer_t object = epx_registry_get(*buffer, EPX_OBJECT_BUFFER);
  if (!object)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "%s: buffer is not a live buffer (destroyed, or not from epx_buffer_create)", caller);
  *buffer = object;
  return EPX_SUCCESS;
}

epx_status_t epx_check_collective_buffer(epx_buffer_t *buffer, const char *caller) {
  epx_status_t status = epx_check_buffer(buffer, caller);
  return status == EPX_SUCCESS ? epx_comm_check_alive((*buffer)->comm, caller) : status;
}

/* The fields every rank must agree on, gathered at buffer creation. */
typedef struct {
  int64_t status;
  int64_t device, dtype, hidden, num_experts, max_top_k, max_tokens_per_rank,
      max_tokens_rounding, exchange, layout, expert_alignment, capacity, combine_precision,
      exchange_path, sm_budget, fp8_format, low_latency, placement_physical, placement_rule, placement_hash;
  /* Not a config field (check_same_nodes): the comm's ranks_per_node where
   * the exchange is hierarchical, 0 elsewhere. */
  int64_t ranks_per_node;
} buffer_shape_t;

static const char *const shape_field_names[] = {
    "status", "device", "dtype", "hidden", "num_experts", "max_top_k", "max_tokens_per_rank",
    "max_tokens_rounding", "exchange", "layout", "expert_alignment", "capacity", "combine_precision",
    "exchange_path", "sm_budget", "fp8_format", "low_latency", "placement->num_physical",
    "placement->replica_rule", "placement (a hash of its physical_to_logical and physical_rank)"};

/* The receive bound of a buffer (epx_buffer_max_recv_rows), every product
 * checked: a dropless rank receives up to min(k, E_local) rows of each of
 * W * max_tokens tokens, plus each expert's alignment padding. */
/* The receive-row bound of the routing spec (core/route_spec.h), once its
 * products are known to fit in 64 bits. */
static epx_status_t recv_rows_bound(const char *fn, const epx_buffer_config_t *c, int64_t W,
                                    int64_t max_tokens, int64_t *rows) {
  if (c->low_latency) return epx_ll_recv_rows_bound(fn, c, W, max_tokens, rows);
  const int64_t El = epx_config_experts_per_rank(c, W);
  const char *tokens = "config.max_tokens_per_rank";
  int64_t k = c->max_top_k < El ? c->max_top_k : El, padding = 0, data = 0, sum = 0;
  epx_status_t status = EPX_SUCCESS;
  switch (c->layout) {
    case EPX_LAYOUT_EXPERT_MAJOR:
      status = EPX_CHECKED_PRODUCT(&data, fn, tokens, "world size * max tokens * top_k (the received rows)",
                                   W, max_tokens, k);
      if (status == EPX_SUCCESS)
        status = EPX_CHECKED_PRODUCT(&padding, fn, "config.expert_alignment",
                                     "experts per rank * (alignment - 1) (the padding rows)", El,
                                     c->expert_alignment - 1);
      if (status == EPX_SUCCESS && epx_add_overflows(data, padding, &sum))
        status = epx_error(EPX_ERROR_INVALID_ARGUMENT,
                           "%s: config.expert_alignment is too large: the received rows with their "
                           "padding do not fit in 64 bits; pass a smaller config.expert_alignment", fn);
      break;
    case EPX_LAYOUT_RANK_MAJOR:
      status = EPX_CHECKED_PRODUCT(&sum, fn, tokens, "world size * max tokens (the received rows)", W, max_tokens);
      break;
    case EPX_LAYOUT_CAPACITY:
      status = EPX_CHECKED_PRODUCT(&sum, fn, "config.capacity", "num_experts * world size * capacity (the received rows)",
                                   El, W, c->capacity);
      break;
    default:
      return epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: config.layout %d is not an epx_layout_t", fn, (int)c->layout);
  }
  if (status == EPX_SUCCESS)
    *rows = epx_recv_rows_bound(c->layout, W, max_tokens, c->max_top_k, El, c->expert_alignment, c->capacity);
  return status;
}

/* Every byte count the buffer can reach fits an int64_t: a row, the rows a
 * rank sends (a copy per selected expert at most) and receives. When the
 * tokens per rank are agreed later, the largest value the agreement can give
 * (2^31 - 1 rounded up) is what is checked. */
static epx_status_t check_buffer_sizes(epx_comm_t comm, const epx_buffer_config_t *c) {
  const char *fn = "epx_buffer_create";
  int64_t row_bytes = 0, send_rows = 0, recv_rows = 0, bytes = 0;
  int64_t rounding = c->max_tokens_rounding;
  int64_t max_tokens = c->max_tokens_per_rank ? c->max_tokens_per_rank
                                              : ((int64_t)INT32_MAX + rounding - 1) / rounding * rounding;
  epx_status_t status = EPX_CHECKED_PRODUCT(&row_bytes, fn, "config.hidden", "hidden * dtype size (a row's bytes)",
                                            c->hidden, (int64_t)epx_dtype_size(c->dtype));
  if (status == EPX_SUCCESS)
    status = EPX_CHECKED_PRODUCT(&send_rows, fn, "config.max_tokens_per_rank",
                                 "max tokens * max_top_k (the rows a rank sends)", max_tokens, c->max_top_k);
  if (status == EPX_SUCCESS)
    status = EPX_CHECKED_PRODUCT(&bytes, fn, "config.hidden", "the bytes a rank sends", send_rows, row_bytes);
  if (status == EPX_SUCCESS) status = recv_rows_bound(fn, c, comm->size, max_tokens, &recv_rows);
  if (status == EPX_SUCCESS)
    status = EPX_CHECKED_PRODUCT(&bytes, fn, "config.hidden", "the bytes a rank receives", recv_rows, row_bytes);
  return status;
}

/* An fp8 format: a known one (CPU and CUDA buffers, one GPU or several:
 * the W-rank backend moves fp8 on its host and fused paths; a CUDA
 * low-latency buffer refuses it, api/ll.c), over a combine dtype of bf16 or
 * f32, with hidden a multiple of its block. */
static epx_status_t check_fp8_format(const epx_buffer_config_t *c) {
  const char *fn = "epx_buffer_create";
  if (c->fp8_format == EPX_FP8_NONE) return EPX_SUCCESS;
  int32_t multiple = epx_fp8_hidden_multiple(c->fp8_format);
  EPX_REQUIRE(multiple, "%s: config.fp8_format %d is not an epx_fp8_format_t", fn, (int)c->fp8_format);
  EPX_REQUIRE(c->dtype == EPX_BFLOAT16 || c->dtype == EPX_FLOAT32,
              "%s: config.dtype %s with an fp8 format: the dtype is what combine and the backward "
              "passes use; pass EPX_BFLOAT16 or EPX_FLOAT32", fn, epx_dtype_name(c->dtype));
  EPX_REQUIRE(c->hidden % multiple == 0,
              "%s: config.hidden is %lld, not a multiple of %d, which config.fp8_format %d needs "
              "(%s); pad the hidden size or pick another format", fn, (long long)c->hidden, multiple,
              (int)c->fp8_format,
              c->fp8_format == EPX_FP8_E4M3_UE8M0_128 ? "a scale per 128 channels, four to an int32 word"
                                                       : "a scale per block of that many channels");
  return EPX_SUCCESS;
}

/* EPX_EXCHANGE_AUTO's rule (epx.h), the same on every rank (the topology is),
 * and what the hierarchical exchange needs. */
static epx_status_t resolve_exchange(epx_comm_t comm, epx_buffer_config_t *c) {
  const char *fn = "epx_buffer_create";
  int spans_nodes = comm->num_nodes > 1 && comm->ranks_per_node > 1;
  const epx_backend_t *backend = epx_backend_for_device(c->device);
  /* A backend may take the hierarchical exchange only when asked for by
   * name (CUDA: its flat exchanges still sum in one level, epx.h). */
  if (c->exchange == EPX_EXCHANGE_AUTO)
    c->exchange = spans_nodes && backend && backend->hierarchical_auto ? EPX_EXCHANGE_HIERARCHICAL
                                                                       : EPX_EXCHANGE_DEDUP;
  if (c->exchange != EPX_EXCHANGE_HIERARCHICAL) return EPX_SUCCESS;
  const char *why = NULL;
  if (backend && backend->supports && !backend->supports(c, &why))
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "%s: config.exchange EPX_EXCHANGE_HIERARCHICAL on a %s buffer with %s is not supported in "
                     "this version; use EPX_EXCHANGE_DEDUP, or EPX_EXCHANGE_AUTO (dedup for such a buffer)", fn,
                     backend->name, why ? why : "this config");
  EPX_REQUIRE(comm->ranks_per_node > 0,
              "%s: config.exchange EPX_EXCHANGE_HIERARCHICAL needs nodes of equal size, and the comm's "
              "nodes differ (epx_comm_topology); use EPX_EXCHANGE_DEDUP, or pose equal nodes with "
              "epx_comm_config_t.ranks_per_node", fn);
  return EPX_SUCCESS;
}

/* The placement's table (config.placement; NULL gives the contiguous map),
 * after which c->placement points at the table's own copy. */
static epx_status_t check_placement(epx_comm_t comm, epx_buffer_config_t *c, epx_placement_table_t **table) {
  const char *fn = "epx_buffer_create";
  epx_status_t status = epx_placement_table_new(fn, "config.placement", c->placement, c->num_experts, comm->size, table);
  if (status == EPX_SUCCESS && c->placement) c->placement = &(*table)->view;
  return status;
}

/* A placement other than the contiguous map where the backend serves it
 * (supports; after the exchange is resolved, so that a refusal of the
 * exchange names the exchange). */
static epx_status_t check_placement_served(const epx_buffer_config_t *c, const epx_placement_table_t *table) {
  const char *fn = "epx_buffer_create", *why = NULL;
  const epx_backend_t *backend = epx_backend_for_device(c->device);
  if (table->contiguous || !backend->supports || backend->supports(c, &why)) return EPX_SUCCESS;
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "%s: config.placement is not the contiguous map (replicas, a caller's replica rule or experts "
                   "moved between ranks), which a %s buffer with %s does not serve in this version; pass NULL, "
                   "or drop that setting", fn, backend->name, why ? why : "this config");
}

/* Reads the caller's config (perhaps from an older, smaller header) over the
 * defaults into *c, and checks it. */
static epx_status_t check_buffer_config(epx_comm_t comm, const epx_buffer_config_t *given,
                                        epx_buffer_config_t *c, epx_placement_table_t **table) {
  const char *fn = "epx_buffer_create";
  EPX_REQUIRE(given, "%s: config is NULL; pass an epx_buffer_config_t from epx_buffer_config_init "
                     "or EPX_BUFFER_CONFIG_INIT", fn);
  *c = (epx_buffer_config_t)EPX_BUFFER_CONFIG_INIT;
  epx_status_t status = epx_config_read(fn, "epx_buffer_config_t", given, c, sizeof *c);
  if (status != EPX_SUCCESS) return status;
  if (!epx_backend_for_device(c->device)) return epx_backend_missing(fn, c->device);
  EPX_REQUIRE(epx_dtype_size(c->dtype), "%s: config.dtype %d is not EPX_FLOAT32, EPX_BFLOAT16 or EPX_FLOAT16", fn, (int)c->dtype);
  EPX_REQUIRE(c->hidden > 0 && c->hidden % 8 == 0,
              "%s: config.hidden is %lld; it must be a positive multiple of 8 (rows are moved in 16-byte vectors)",
              fn, (long long)c->hidden);
  EPX_REQUIRE(c->num_experts >= 1 && (c->placement || c->num_experts % comm->size == 0),
              "%s: config.num_experts is %d; it must be a positive multiple of the comm size %d "
              "(or give a config.placement)", fn, c->num_experts, comm->size);
  status = check_placement(comm, c, table);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(c->max_top_k >= 1 && c->max_top_k <= c->num_experts,
              "%s: config.max_top_k is %d; it must be in [1, num_experts = %d]", fn, c->max_top_k, c->num_experts);
  EPX_REQUIRE(c->max_tokens_per_rank >= 0 && c->max_tokens_per_rank <= INT32_MAX,
              "%s: config.max_tokens_per_rank is %lld; pass a count in [0, 2^31) (0 agrees it at the first dispatch)",
              fn, (long long)c->max_tokens_per_rank);
  EPX_REQUIRE(c->max_tokens_rounding >= 1, "%s: config.max_tokens_rounding is %d; pass >= 1", fn, c->max_tokens_rounding);
  EPX_REQUIRE(c->exchange >= EPX_EXCHANGE_DEDUP && c->exchange <= EPX_EXCHANGE_AUTO,
              "%s: config.exchange %d is not EPX_EXCHANGE_DEDUP, _COLLECTIVE, _HIERARCHICAL or _AUTO", fn,
              (int)c->exchange);
  status = resolve_exchange(comm, c);
  if (status == EPX_SUCCESS) status = check_placement_served(c, *table);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(c->layout == EPX_LAYOUT_EXPERT_MAJOR || c->layout == EPX_LAYOUT_RANK_MAJOR ||
                  c->layout == EPX_LAYOUT_CAPACITY,
              "%s: config.layout %d is not an epx_layout_t", fn, (int)c->layout);
  EPX_REQUIRE(c->expert_alignment >= 1, "%s: config.expert_alignment is %d; pass >= 1 (1 = no padding)", fn, c->expert_alignment);
  EPX_REQUIRE(c->layout != EPX_LAYOUT_CAPACITY || c->capacity >= 1,
              "%s: config.capacity is %d; EPX_LAYOUT_CAPACITY needs the capacity C >= 1 (epx_route_output_t.capacity)",
              fn, c->capacity);
  EPX_REQUIRE(c->capacity >= 0, "%s: config.capacity is %d; pass >= 0", fn, c->capacity);
  EPX_REQUIRE(c->combine_precision == EPX_COMBINE_PARTIALS_FLOAT32 ||
                  c->combine_precision == EPX_COMBINE_PARTIALS_PAYLOAD,
              "%s: config.combine_precision %d is not EPX_COMBINE_PARTIALS_FLOAT32 or "
              "EPX_COMBINE_PARTIALS_PAYLOAD", fn, (int)c->combine_precision);
  EPX_REQUIRE(c->exchange_path == EPX_PATH_AUTO || c->exchange_path == EPX_PATH_HOST ||
                  c->exchange_path == EPX_PATH_FUSED,
              "%s: config.exchange_path %d is not EPX_PATH_AUTO, EPX_PATH_HOST or EPX_PATH_FUSED", fn,
              (int)c->exchange_path);
  EPX_REQUIRE(c->sm_budget >= 0 && c->sm_budget <= 1024,
              "%s: config.sm_budget is %d; pass the CTAs of the fused kernels in [1, 1024], or 0 for the "
              "default (32)", fn, c->sm_budget);
  status = check_fp8_format(c);
  if (status == EPX_SUCCESS) status = epx_ll_check_config(c);
  return status != EPX_SUCCESS ? status : check_buffer_sizes(comm, c);
}

/* Names the rank whose value is the odd one out: compares each rank with the
 * value most ranks have. */
static epx_status_t check_same_shape(const buffer_shape_t *all, int32_t size, const char *fn) {
  for (size_t f = 0; f < sizeof shape_field_names / sizeof *shape_field_names - 1; f++) {
    int64_t common = (&all[0].device)[f];
    int32_t best = 0;
    for (int32_t r = 0; r < size; r++) {
      int32_t votes = 0;
      for (int32_t q = 0; q < size; q++) votes += (&all[q].device)[f] == (&all[r].device)[f];
      if (votes > best) best = votes, common = (&all[r].device)[f];
    }
    for (int32_t r = 0; r < size; r++) {
      int64_t theirs = (&all[r].device)[f];
      if (theirs == common) continue;
      const char *field = shape_field_names[f + 1];
      char theirs_text[24], common_text[24];
      return epx_error(EPX_ERROR_SHAPE_MISMATCH,
                       "%s: rank %d has config.%s = %s but %d of %d ranks have %s; every rank "
                       "must create the buffer with the same %s", fn, r, field,
                       epx_config_value_text(field, theirs, theirs_text, sizeof theirs_text), best, size,
                       epx_config_value_text(field, common, common_text, sizeof common_text), field);
    }
  }
  return EPX_SUCCESS;
}

/* The hierarchical exchange plans its two levels from the comm's nodes: ranks
 * whose comms pose different nodes would send counts the peers do not
 * expect (an alltoallv size mismatch at the first layout, the comm lost). */
static epx_status_t check_same_nodes(const buffer_shape_t *all, int32_t size, const char *fn) {
  for (int32_t r = 1; r < size; r++)
    if (all[r].ranks_per_node != all[0].ranks_per_node)
      return epx_error(EPX_ERROR_SHAPE_MISMATCH,
                       "%s: config.exchange is EPX_EXCHANGE_HIERARCHICAL but rank %d's comm has "
                       "ranks_per_node %lld and rank 0's has %lld; the exchange needs the same nodes "
                       "on every rank: create the comm with the same epx_comm_config_t.ranks_per_node "
                       "on every rank (or use EPX_EXCHANGE_DEDUP)",
                       fn, r, (long long)all[r].ranks_per_node, (long long)all[0].ranks_per_node);
  return EPX_SUCCESS;
}

/* Every rank sends its shape (or its failure `local`) so all refuse together. */
static epx_status_t agree_shape(epx_comm_t comm, const epx_buffer_config_t *config,
                                const epx_placement_table_t *table, epx_status_t local, const char *fn) {
  buffer_shape_t mine = {0};
  mine.status = local;
  if (local == EPX_SUCCESS)
    mine = (buffer_shape_t){0, config->device, config->dtype, config->hidden, config->num_experts,
                            config->max_top_k, config->max_tokens_per_rank, config->max_tokens_rounding,
                            config->exchange, config->layout, config->expert_alignment, config->capacity,
                            config->combine_precision, config->exchange_path, config->sm_budget,
                            config->fp8_format, config->low_latency, table->num_physical, table->rule, 0,
                            config->exchange == EPX_EXCHANGE_HIERARCHICAL ? comm->ranks_per_node : 0};
  if (local == EPX_SUCCESS) memcpy(&mine.placement_hash, &table->hash, sizeof mine.placement_hash);
  char message[1024];
  strncpy(message, epx_last_error(), sizeof message - 1);
  message[sizeof message - 1] = '\0';
  buffer_shape_t *all = calloc((size_t)comm->size, sizeof *all);
  if (!all) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  epx_status_t status = epx_comm_check_alive(comm, fn);
  if (status == EPX_SUCCESS) status = comm->ops->allgather(comm, fn, &mine, all, sizeof mine);
  if (status != EPX_SUCCESS) goto done;
  if (local != EPX_SUCCESS) {
    status = epx_error(local, "%s", message);
    goto done;
  }
  for (int32_t r = 0; r < comm->size; r++) {
    if (all[r].status != EPX_SUCCESS) {
      status = epx_error(EPX_ERROR_PEER_FAILED, "%s: rank %d refused its config (its epx_last_error says why)", fn, r);
      goto done;
    }
  }
  status = check_same_shape(all, comm->size, fn);
  if (status == EPX_SUCCESS) status = check_same_nodes(all, comm->size, fn);
done:
  free(all);
  return status;
}

epx_status_t epx_buffer_create(epx_comm_t comm, const epx_buffer_config_t *config,
                               epx_buffer_t *buffer) {
  const char *fn = "epx_buffer_create";
  epx_error_clear();
  epx_status_t checked = epx_check_comm(&comm, fn);
  if (checked != EPX_SUCCESS) return checked;
  epx_buffer_config_t full;
  epx_placement_table_t *table = NULL;
  epx_status_t local = buffer ? check_buffer_config(comm, config, &full, &table)
                              : epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: buffer is NULL; pass the address of an epx_buffer_t", fn);
  config = &full;
  epx_status_t status = agree_shape(comm, config, table, local, fn);
  epx_buffer_t b = status == EPX_SUCCESS ? calloc(1, sizeof *b) : NULL;
  int64_t *load = status == EPX_SUCCESS ? calloc((size_t)config->num_experts, sizeof(int64_t)) : NULL;
  if (status == EPX_SUCCESS && (!b || !load)) status = epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory", fn);
  if (status != EPX_SUCCESS) {
    epx_placement_table_free(table);
    free(b);
    free(load);
    return status;
  }
  b->comm = comm;
  b->config = *config;
  b->world_size = comm->size;
  b->rank = comm->rank;
  b->placement = table;
  b->expert_load = load;
  b->experts_per_rank = table->per_rank;
  b->max_tokens = config->max_tokens_per_rank;
  b->backend = epx_backend_for_device(config->device);
  status = b->backend->buffer_init(b);
  void *id = NULL;
  if (status == EPX_SUCCESS) {
    status = epx_registry_add(b, EPX_OBJECT_BUFFER, &id);
    if (status != EPX_SUCCESS) b->backend->buffer_fini(b);
  }
  if (status != EPX_SUCCESS) {
    epx_placement_table_free(table);
    free(load);
    free(b);
    return status;
  }
  __atomic_add_fetch(&comm->live_buffers, 1, __ATOMIC_SEQ_CST);
  *buffer = id;
  return EPX_SUCCESS;
}

epx_status_t epx_buffer_destroy(epx_buffer_t buffer) {
  epx_error_clear();
  if (!buffer) return EPX_SUCCESS;
  const epx_buffer_t id = buffer;
  epx_status_t status = epx_check_buffer(&buffer, "epx_buffer_destroy");
  if (status != EPX_SUCCESS) return status;
  int64_t live = __atomic_load_n(&buffer->live_handles, __ATOMIC_SEQ_CST);
  if (live > 0)
    return epx_error(EPX_ERROR_BUSY,
                     "epx_buffer_destroy: %lld handle(s) from this buffer are still alive (a backward "
                     "may still need them); release them with epx_handle_release or "
                     "epx_recorder_destroy first", (long long)live);
  epx_registry_remove(id);
  buffer->backend->buffer_fini(buffer);
  __atomic_sub_fetch(&buffer->comm->live_buffers, 1, __ATOMIC_SEQ_CST);
  epx_placement_table_free(buffer->placement);
  free(buffer->expert_load);
  free(buffer);
  return EPX_SUCCESS;
}

/* The int64_t queries' entry: a valid buffer and the answer's place `out`
 * (the argument `name`). */
static epx_status_t check_count_query(epx_buffer_t *buffer, const int64_t *out, const char *fn, const char *name) {
  epx_error_clear();
  epx_status_t status = epx_check_buffer(buffer, fn);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(out, "%s: %s is NULL; pass an int64_t to fill", fn, name);
  return EPX_SUCCESS;
}

epx_status_t epx_buffer_max_tokens(epx_buffer_t buffer, int64_t *max_tokens_per_rank) {
  epx_status_t status =
      check_count_query(&buffer, max_tokens_per_rank, "epx_buffer_max_tokens", "max_tokens_per_rank");
  if (status != EPX_SUCCESS) return status;
  *max_tokens_per_rank = buffer->max_tokens;
  return EPX_SUCCESS;
}

epx_status_t epx_buffer_max_recv_rows(epx_buffer_t buffer, int64_t *rows) {
  epx_status_t status = check_count_query(&buffer, rows, "epx_buffer_max_recv_rows", "rows");
  if (status != EPX_SUCCESS) return status;
  if (buffer->max_tokens == 0 && buffer->config.layout != EPX_LAYOUT_CAPACITY)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "epx_buffer_max_recv_rows: max_tokens_per_rank is not agreed yet; set "
                     "config.max_tokens_per_rank or call after the first epx_dispatch_layout");
  return recv_rows_bound("epx_buffer_max_recv_rows", &buffer->config, buffer->world_size,
                         buffer->max_tokens, rows);
}

epx_status_t epx_buffer_set_stream(epx_buffer_t buffer, void *stream) {
  epx_error_clear();
  epx_status_t status = epx_check_buffer(&buffer, "epx_buffer_set_stream");
  if (status != EPX_SUCCESS) return status;
  if (!buffer->backend->set_stream)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT, "epx_buffer_set_stream: the buffer is a %s buffer; streams are for EPX_DEVICE_CUDA buffers",
                     buffer->backend->name);
  return buffer->backend->set_stream(buffer, stream);
}

epx_status_t epx_buffer_peer_paths(epx_buffer_t buffer, int32_t *paths) {
  epx_error_clear();
  epx_status_t status = epx_check_buffer(&buffer, "epx_buffer_peer_paths");
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(paths, "epx_buffer_peer_paths: paths is NULL; pass an int32_t array of the comm's size (%d)",
              buffer->world_size);
  for (int32_t r = 0; r < buffer->world_size; r++) paths[r] = EPX_PATH_HOST;
  if (buffer->backend->peer_paths) buffer->backend->peer_paths(buffer, paths);
  return EPX_SUCCESS;
}
