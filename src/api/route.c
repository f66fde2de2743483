/* The public routing calls: every argument checked here, then the route
 * config's device's backend routes (src/cpu/route.c, src/cuda/route/route.c); the
 * float64 reference (src/cpu/route_reference.c) behind the same checks; and
 * the two small collectives of routing options (agreed dropless capacity,
 * summed counts for the global aux loss). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/backends.h"
#include "core/backend.h"
#include "core/checked.h"
#include "core/config.h"
#include "core/error.h"
#include "core/registry.h"
#include "core/route_spec.h"
#include "core/transport.h"
#include "cpu/cpu.h"

static int route_misaligned(const void *p) { return ((uintptr_t)p & 3u) != 0; }

static epx_status_t route_check_options(const char *fn, const epx_route_config_t *c);

/* Reads the caller's config (perhaps from an older, smaller header) over the
 * defaults into *c, and checks it. */
static epx_status_t route_check_config(const char *fn, const epx_route_config_t *given,
                                       epx_route_config_t *c) {
  EPX_REQUIRE(given, "%s: config is NULL; pass an epx_route_config_t initialised with "
                     "EPX_ROUTE_CONFIG_INIT", fn);
  *c = (epx_route_config_t)EPX_ROUTE_CONFIG_INIT;
  epx_status_t status = epx_config_read(fn, "epx_route_config_t", given, c, sizeof *c);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(c->num_experts >= 1, "%s: num_experts is %d; pass at least 1 expert", fn,
              c->num_experts);
  EPX_REQUIRE(c->top_k >= 1, "%s: top_k is %d; pass 1 <= top_k <= num_experts", fn, c->top_k);
  EPX_REQUIRE(c->top_k <= c->num_experts,
              "%s: top_k %d exceeds num_experts %d; pass 1 <= top_k <= num_experts", fn,
              c->top_k, c->num_experts);
  EPX_REQUIRE(c->score_fn >= EPX_SCORE_SOFTMAX && c->score_fn <= EPX_SCORE_SQRT_SOFTPLUS,
              "%s: score_fn is %d; pass EPX_SCORE_SOFTMAX, EPX_SCORE_SIGMOID, "
              "EPX_SCORE_SOFTMAX_AFTER_TOPK or EPX_SCORE_SQRT_SOFTPLUS", fn, (int)c->score_fn);
  if (c->num_groups > 1) {
    EPX_REQUIRE(c->num_experts % c->num_groups == 0,
                "%s: num_groups %d does not divide num_experts %d; pass a divisor of "
                "num_experts, or num_groups <= 1 to disable group-limited selection",
                fn, c->num_groups, c->num_experts);
    EPX_REQUIRE(c->topk_groups >= 1 && c->topk_groups <= c->num_groups,
                "%s: topk_groups is %d; pass 1 <= topk_groups <= num_groups (%d)", fn,
                c->topk_groups, c->num_groups);
    EPX_REQUIRE((int64_t)c->topk_groups * (c->num_experts / c->num_groups) >= c->top_k,
                "%s: topk_groups %d keeps only %d experts, fewer than top_k %d; raise "
                "topk_groups or lower top_k", fn, c->topk_groups,
                c->topk_groups * (c->num_experts / c->num_groups), c->top_k);
  }
  EPX_REQUIRE(c->renormalize == 0 || c->renormalize == 1, "%s: renormalize is %d; pass 0 or 1",
              fn, c->renormalize);
  EPX_REQUIRE(isfinite(c->scaling_factor), "%s: scaling_factor is %g; pass a finite number", fn,
              (double)c->scaling_factor);
  EPX_REQUIRE(c->capacity_mode == 0 || c->capacity_mode == 1,
              "%s: capacity_mode is %d; pass 0 (dropless) or 1 (capacity)", fn,
              c->capacity_mode);
  EPX_REQUIRE(c->queue_order == EPX_QUEUE_BY_CHOICE || c->queue_order == EPX_QUEUE_BY_TOKEN,
              "%s: queue_order is %d; pass EPX_QUEUE_BY_CHOICE or EPX_QUEUE_BY_TOKEN", fn,
              (int)c->queue_order);
  EPX_REQUIRE(c->drop_policy >= EPX_DROP_BY_POSITION &&
                  c->drop_policy <= EPX_DROP_BY_RANDOM_PRIORITY,
              "%s: drop_policy is %d; pass EPX_DROP_BY_POSITION, EPX_DROP_BY_PROBABILITY, "
              "EPX_DROP_BY_SCORE or EPX_DROP_BY_RANDOM_PRIORITY", fn, (int)c->drop_policy);
  EPX_REQUIRE(c->capacity_arithmetic == EPX_CAPACITY_FLOAT32 ||
                  c->capacity_arithmetic == EPX_CAPACITY_FLOAT64,
              "%s: capacity_arithmetic is %d; pass EPX_CAPACITY_FLOAT32 or EPX_CAPACITY_FLOAT64",
              fn, (int)c->capacity_arithmetic);
  if (c->capacity_mode && c->capacity_arithmetic == EPX_CAPACITY_FLOAT32)
    EPX_REQUIRE(isfinite(epx_route_capacity_factor(c)) && epx_route_capacity_factor(c) > 0 &&
                    c->capacity_factor_f64 >= 0,
                "%s: capacity_factor is %g and capacity_factor_f64 %g; pass a finite factor > 0 "
                "in capacity mode (capacity_factor_f64 when set, else capacity_factor)",
                fn, (double)c->capacity_factor, c->capacity_factor_f64);
  if (c->capacity_mode && c->capacity_arithmetic == EPX_CAPACITY_FLOAT64)
    EPX_REQUIRE(c->capacity_factor_f64 > 0 && isfinite(c->capacity_factor_f64),
                "%s: capacity_factor_f64 is %g; pass a finite capacity_factor_f64 > 0 with "
                "EPX_CAPACITY_FLOAT64", fn, c->capacity_factor_f64);
  if (c->capacity_mode)
    EPX_REQUIRE(c->min_capacity >= 0, "%s: min_capacity is %d; pass min_capacity >= 0", fn,
                c->min_capacity);
  return route_check_options(fn, c);
}

/* The options of the drop-in parity fields (after `stream`). */
static epx_status_t route_check_options(const char *fn, const epx_route_config_t *c) {
  EPX_REQUIRE(c->renormalize_after_drop == 0 || c->renormalize_after_drop == 1,
              "%s: renormalize_after_drop is %d; pass 0 or 1", fn, c->renormalize_after_drop);
  EPX_REQUIRE(!c->renormalize_after_drop || c->renormalize,
              "%s: renormalize_after_drop is 1 but renormalize is 0; set renormalize = 1 to "
              "renormalise over the surviving routes", fn);
  EPX_REQUIRE(c->group_score_experts >= 0,
              "%s: group_score_experts is %d; pass 0 (the best 2) or the experts to sum", fn,
              c->group_score_experts);
  EPX_REQUIRE(c->aux_counts >= EPX_AUX_COUNTS_SELECTED && c->aux_counts <= EPX_AUX_COUNTS_PLAIN_TOPK,
              "%s: aux_counts is %d; pass EPX_AUX_COUNTS_SELECTED, EPX_AUX_COUNTS_FIRST_CHOICE or "
              "EPX_AUX_COUNTS_PLAIN_TOPK", fn, (int)c->aux_counts);
  EPX_REQUIRE(c->aux_loss_sequences >= 0, "%s: aux_loss_sequences is %d; pass 0 or the sequences "
              "of the batch", fn, c->aux_loss_sequences);
  EPX_REQUIRE(!c->aux_loss_expert_counts || c->aux_loss_sequences <= 1,
              "%s: aux_loss_expert_counts (the global aux loss) and aux_loss_sequences %d (the "
              "sequence-level one) are both set; pick one", fn, c->aux_loss_sequences);
  if (c->aux_loss_expert_counts)
    EPX_REQUIRE(c->aux_loss_tokens > 0 && isfinite(c->aux_loss_tokens),
                "%s: aux_loss_tokens is %g; pass the global batch's token count (> 0) with "
                "aux_loss_expert_counts", fn, c->aux_loss_tokens);
  EPX_REQUIRE(!route_misaligned(c->aux_loss_expert_counts),
              "%s: aux_loss_expert_counts (%p) is not 4-byte aligned; pass a 4-byte aligned "
              "array", fn, (const void *)c->aux_loss_expert_counts);
  EPX_REQUIRE(isfinite(c->aux_loss_coeff), "%s: aux_loss_coeff is %g; pass a finite number", fn,
              (double)c->aux_loss_coeff);
  EPX_REQUIRE(isfinite(c->z_loss_coeff), "%s: z_loss_coeff is %g; pass a finite number", fn,
              (double)c->z_loss_coeff);
  EPX_REQUIRE(c->nonfinite == EPX_NONFINITE_ERROR || c->nonfinite == EPX_NONFINITE_DROP,
              "%s: nonfinite is %d; pass EPX_NONFINITE_ERROR or EPX_NONFINITE_DROP", fn,
              (int)c->nonfinite);
  EPX_REQUIRE(c->device == EPX_DEVICE_CPU || c->device == EPX_DEVICE_CUDA,
              "%s: device is %d; pass EPX_DEVICE_CPU or EPX_DEVICE_CUDA", fn, (int)c->device);
  return EPX_SUCCESS;
}

/* Locations are int32 and an expert's queue holds up to T routes; the
 * logits' byte count must fit as well (core/checked.h). */
static epx_status_t route_check_tokens(const char *fn, const epx_route_config_t *c,
                                       int64_t num_tokens) {
  EPX_REQUIRE(num_tokens >= 0, "%s: num_tokens is %lld; pass num_tokens >= 0", fn,
              (long long)num_tokens);
  EPX_REQUIRE(num_tokens <= INT32_MAX,
              "%s: num_tokens is %lld, more than the int32 locations can index; route at "
              "most %d tokens per call", fn, (long long)num_tokens, INT32_MAX);
  EPX_REQUIRE(c->aux_loss_sequences <= 1 || num_tokens % c->aux_loss_sequences == 0,
              "%s: num_tokens %lld is not a multiple of aux_loss_sequences %d; pass whole "
              "sequences (token t is in sequence t %% aux_loss_sequences)", fn,
              (long long)num_tokens, c->aux_loss_sequences);
  int64_t bytes = 0;
  return EPX_CHECKED_PRODUCT(&bytes, fn, "num_tokens", "num_tokens * num_experts * 4 (the logits' bytes)",
                             num_tokens, c->num_experts, (int64_t)sizeof(float));
}

static epx_status_t route_check_pointer(const char *fn, const char *name, const void *p,
                                        int required) {
  EPX_REQUIRE(p || !required, "%s: %s is NULL; pass a 4-byte aligned array", fn, name);
  EPX_REQUIRE(!route_misaligned(p), "%s: %s (%p) is not 4-byte aligned; pass a 4-byte aligned "
              "array", fn, name, p);
  return EPX_SUCCESS;
}

/* What every routing call starts with: the caller's config read over the
 * defaults into *full (an older, smaller struct_size included) and checked,
 * and the token count checked against it. */
static epx_status_t route_begin(const char *fn, const epx_route_config_t *config, int64_t num_tokens,
                                epx_route_config_t *full) {
  epx_error_clear();
  epx_status_t status = route_check_config(fn, config, full);
  return status != EPX_SUCCESS ? status : route_check_tokens(fn, full, num_tokens);
}

/* The backend of the config's device, or the error naming the rebuild. */
static epx_status_t route_backend(const char *fn, epx_device_t device, const epx_backend_t **backend) {
  *backend = epx_backend_for_device(device);
  return *backend ? EPX_SUCCESS : epx_backend_missing(fn, device);
}

epx_status_t epx_route(const epx_route_config_t *config, int64_t num_tokens, const float *logits,
                       const float *bias, epx_route_output_t *output) {
  epx_route_config_t full;
  epx_status_t status = route_begin("epx_route", config, num_tokens, &full);
  if (status != EPX_SUCCESS) return status;
  config = &full;
  if ((status = route_check_pointer("epx_route", "logits", logits, num_tokens > 0)) != EPX_SUCCESS)
    return status;
  if ((status = route_check_pointer("epx_route", "bias", bias, 0)) != EPX_SUCCESS) return status;
  EPX_REQUIRE(output, "epx_route: output is NULL; pass an epx_route_output_t with topk_idx and "
                      "topk_w set");
  const int has_routes = num_tokens > 0;
  if ((status = route_check_pointer("epx_route", "output->topk_idx", output->topk_idx,
                                    has_routes)) != EPX_SUCCESS ||
      (status = route_check_pointer("epx_route", "output->topk_w", output->topk_w,
                                    has_routes)) != EPX_SUCCESS ||
      (status = route_check_pointer("epx_route", "output->locations", output->locations, 0)) !=
          EPX_SUCCESS ||
      (status = route_check_pointer("epx_route", "output->expert_counts",
                                    output->expert_counts, 0)) != EPX_SUCCESS ||
      (status = route_check_pointer("epx_route", "output->aux_loss", output->aux_loss, 0)) !=
          EPX_SUCCESS ||
      (status = route_check_pointer("epx_route", "output->z_loss", output->z_loss, 0)) !=
          EPX_SUCCESS)
    return status;
  const epx_backend_t *backend;
  if ((status = route_backend("epx_route", config->device, &backend)) != EPX_SUCCESS) return status;
  return backend->route(config, num_tokens, logits, bias, output);
}

epx_status_t epx_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                const float *logits, const float *bias, const int32_t *topk_idx,
                                const float *grad_topk_w, float grad_aux_loss, float grad_z_loss,
                                float *grad_logits) {
  static const char fn[] = "epx_route_backward";
  epx_route_config_t full;
  epx_status_t status = route_begin(fn, config, num_tokens, &full);
  if (status != EPX_SUCCESS) return status;
  config = &full;
  const int has_rows = num_tokens > 0;
  if ((status = route_check_pointer(fn, "logits", logits, has_rows)) != EPX_SUCCESS ||
      (status = route_check_pointer(fn, "bias", bias, 0)) != EPX_SUCCESS ||
      (status = route_check_pointer(fn, "topk_idx", topk_idx, has_rows)) != EPX_SUCCESS ||
      (status = route_check_pointer(fn, "grad_topk_w", grad_topk_w, 0)) != EPX_SUCCESS ||
      (status = route_check_pointer(fn, "grad_logits", grad_logits, has_rows)) != EPX_SUCCESS)
    return status;
  EPX_REQUIRE(isfinite(grad_aux_loss), "%s: grad_aux_loss is %g; pass a finite gradient", fn,
              (double)grad_aux_loss);
  EPX_REQUIRE(isfinite(grad_z_loss), "%s: grad_z_loss is %g; pass a finite gradient", fn,
              (double)grad_z_loss);
  const epx_backend_t *backend;
  if ((status = route_backend(fn, config->device, &backend)) != EPX_SUCCESS) return status;
  return backend->route_backward(config, num_tokens, logits, bias, topk_idx, grad_topk_w,
                                 grad_aux_loss, grad_z_loss, grad_logits);
}

epx_status_t epx_route_capacity_of(const epx_route_config_t *config, int64_t num_tokens,
                                   int32_t *capacity) {
  static const char fn[] = "epx_route_capacity_of";
  epx_error_clear();
  EPX_REQUIRE(capacity, "%s: capacity is NULL; pass an int32_t to write C to", fn);
  epx_route_config_t full;
  epx_status_t status = route_check_config(fn, config, &full);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(num_tokens >= 0, "%s: num_tokens is %lld; pass num_tokens >= 0", fn, (long long)num_tokens);
  *capacity = epx_route_capacity(&full, num_tokens);
  return EPX_SUCCESS;
}

epx_status_t epx_reference_route(const epx_route_config_t *config, int64_t num_tokens,
                                 const float *logits, const float *bias, int32_t *topk_idx,
                                 double *topk_w, int32_t *locations, int32_t *expert_counts,
                                 double *aux_loss, double *z_loss, int32_t *capacity) {
  static const char fn[] = "epx_reference_route";
  epx_route_config_t full;
  epx_status_t status = route_begin(fn, config, num_tokens, &full);
  if (status != EPX_SUCCESS) return status;
  config = &full;
  const int has_rows = num_tokens > 0;
  EPX_REQUIRE(!has_rows || (logits && topk_idx && topk_w),
              "%s: logits, topk_idx and topk_w must not be NULL; pass host arrays", fn);
  return epx_cpu_reference_route(config, num_tokens, logits, bias, topk_idx, topk_w, locations,
                                 expert_counts, aux_loss, z_loss, capacity);
}

epx_status_t epx_reference_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                          const float *logits, const float *bias,
                                          const int32_t *topk_idx, const float *grad_topk_w,
                                          double grad_aux_loss, double grad_z_loss,
                                          double *grad_logits) {
  static const char fn[] = "epx_reference_route_backward";
  epx_route_config_t full;
  epx_status_t status = route_begin(fn, config, num_tokens, &full);
  if (status != EPX_SUCCESS) return status;
  config = &full;
  EPX_REQUIRE(num_tokens == 0 || (logits && topk_idx && grad_logits),
              "%s: logits, topk_idx and grad_logits must not be NULL; pass host arrays", fn);
  return epx_cpu_reference_route_backward(config, num_tokens, logits, bias, topk_idx, grad_topk_w,
                                          grad_aux_loss, grad_z_loss, grad_logits);
}

/* A comm argument of the routing collectives. A NULL or dead comm returns at
 * once: its peers then time out naming this rank (epx.h's convention). */
static epx_status_t route_check_comm(const char *fn, epx_comm_t *comm) {
  epx_comm_t object = epx_registry_get(*comm, EPX_OBJECT_COMM);
  if (!object)
    return epx_error(*comm ? EPX_ERROR_INVALID_HANDLE : EPX_ERROR_INVALID_ARGUMENT,
                     "%s: comm is %s; pass a comm from epx_comm_create_*", fn,
                     *comm ? "not a live comm (destroyed?)" : "NULL");
  *comm = object;
  return epx_comm_check_alive(object, fn);
}

/* One all-reduce MAX of (refused, the largest count): a rank's refusal
 * travels with the values, so every rank refuses together. */
epx_status_t epx_route_agree_capacity(epx_comm_t comm, int32_t num_experts,
                                      const int32_t *expert_counts, int32_t *capacity) {
  static const char fn[] = "epx_route_agree_capacity";
  epx_error_clear();
  epx_status_t status = route_check_comm(fn, &comm);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = EPX_SUCCESS;
  if (num_experts < 1 || !expert_counts || !capacity)
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: num_experts is %d, expert_counts %p, "
                      "capacity %p; pass num_experts >= 1 and two host arrays", fn, num_experts,
                      (const void *)expert_counts, (void *)capacity);
  int64_t values[2] = {local != EPX_SUCCESS, 0};
  for (int32_t e = 0; local == EPX_SUCCESS && e < num_experts; e++)
    if (expert_counts[e] > values[1]) values[1] = expert_counts[e];
  status = comm->ops->allreduce_max_i64(comm, fn, values, 2);
  if (status != EPX_SUCCESS || local != EPX_SUCCESS) return status != EPX_SUCCESS ? status : local;
  if (values[0])
    return epx_error(EPX_ERROR_PEER_FAILED, "%s: a peer refused its arguments (its "
                     "epx_last_error says why)", fn);
  *capacity = (int32_t)values[1];
  return EPX_SUCCESS;
}

/* One all-gather of (refused, counts [E]) rows, summed in rank order. */
epx_status_t epx_route_sum_counts(epx_comm_t comm, int32_t num_experts, const int32_t *local_counts,
                                  float *global) {
  static const char fn[] = "epx_route_sum_counts";
  epx_error_clear();
  epx_status_t status = route_check_comm(fn, &comm);
  if (status != EPX_SUCCESS) return status;
  epx_status_t local = EPX_SUCCESS;
  if (num_experts < 1 || !local_counts || !global)
    local = epx_error(EPX_ERROR_INVALID_ARGUMENT, "%s: num_experts is %d, local %p, global %p; "
                      "pass num_experts >= 1 and two host arrays", fn, num_experts,
                      (const void *)local_counts, (void *)global);
  /* Every rank must send the same bytes: a refusing rank with a bad
   * num_experts still sends a row of the size it was given (at least 1). */
  const size_t row = (size_t)(num_experts > 0 ? num_experts : 0) + 1;
  int64_t *mine = calloc(row, sizeof *mine);
  int64_t *all = calloc(row * (size_t)comm->size, sizeof *all);
  if (!mine || !all) {
    free(mine);
    free(all);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for %d counts", fn, num_experts);
  }
  mine[0] = local != EPX_SUCCESS;
  for (int32_t e = 0; local == EPX_SUCCESS && e < num_experts; e++) mine[1 + e] = local_counts[e];
  status = comm->ops->allgather(comm, fn, mine, all, row * sizeof *mine);
  if (status == EPX_SUCCESS && local != EPX_SUCCESS) status = local;
  for (int32_t r = 0; status == EPX_SUCCESS && r < comm->size; r++)
    if (all[(size_t)r * row])
      status = epx_error(EPX_ERROR_PEER_FAILED, "%s: rank %d refused its arguments (its "
                         "epx_last_error says why)", fn, r);
  if (status == EPX_SUCCESS) {
    for (int32_t e = 0; e < num_experts; e++) {
      int64_t sum = 0;
      for (int32_t r = 0; r < comm->size; r++) sum += all[(size_t)r * row + 1 + e];
      global[e] = (float)sum;
    }
  }
  free(mine);
  free(all);
  return status;
}
