/* The public routing calls: every argument checked here, then the route
 * config's device's backend routes (src/cpu/route.c, src/cuda). */
#include <math.h>
#include <stdint.h>

#include "api/backends.h"
#include "core/backend.h"
#include "core/config.h"
#include "core/error.h"

static int route_misaligned(const void *p) { return ((uintptr_t)p & 3u) != 0; }

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
  EPX_REQUIRE(c->score_fn == EPX_SCORE_SOFTMAX || c->score_fn == EPX_SCORE_SIGMOID,
              "%s: score_fn is %d; pass EPX_SCORE_SOFTMAX or EPX_SCORE_SIGMOID", fn,
              (int)c->score_fn);
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
  EPX_REQUIRE(c->drop_policy == EPX_DROP_BY_POSITION || c->drop_policy == EPX_DROP_BY_PROBABILITY,
              "%s: drop_policy is %d; pass EPX_DROP_BY_POSITION or EPX_DROP_BY_PROBABILITY", fn,
              (int)c->drop_policy);
  if (c->capacity_mode) {
    EPX_REQUIRE(c->capacity_factor > 0 && isfinite(c->capacity_factor),
                "%s: capacity_factor is %g; pass a finite capacity_factor > 0 in capacity mode",
                fn, (double)c->capacity_factor);
    EPX_REQUIRE(c->min_capacity >= 0, "%s: min_capacity is %d; pass min_capacity >= 0", fn,
                c->min_capacity);
  }
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

/* Locations are int32 and an expert's queue holds up to T routes. */
static epx_status_t route_check_tokens(const char *fn, int64_t num_tokens) {
  EPX_REQUIRE(num_tokens >= 0, "%s: num_tokens is %lld; pass num_tokens >= 0", fn,
              (long long)num_tokens);
  EPX_REQUIRE(num_tokens <= INT32_MAX,
              "%s: num_tokens is %lld, more than the int32 locations can index; route at "
              "most %d tokens per call", fn, (long long)num_tokens, INT32_MAX);
  return EPX_SUCCESS;
}

static epx_status_t route_check_pointer(const char *fn, const char *name, const void *p,
                                        int required) {
  EPX_REQUIRE(p || !required, "%s: %s is NULL; pass a 4-byte aligned array", fn, name);
  EPX_REQUIRE(!route_misaligned(p), "%s: %s (%p) is not 4-byte aligned; pass a 4-byte aligned "
              "array", fn, name, p);
  return EPX_SUCCESS;
}

epx_status_t epx_route(const epx_route_config_t *config, int64_t num_tokens, const float *logits,
                       const float *bias, epx_route_output_t *output) {
  epx_status_t status;
  epx_route_config_t full;
  epx_error_clear();
  if ((status = route_check_config("epx_route", config, &full)) != EPX_SUCCESS) return status;
  config = &full;
  if ((status = route_check_tokens("epx_route", num_tokens)) != EPX_SUCCESS) return status;
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
  const epx_backend_t *backend = epx_backend_for_device(config->device);
  if (!backend) return epx_backend_missing("epx_route", config->device);
  return backend->route(config, num_tokens, logits, bias, output);
}

epx_status_t epx_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                const float *logits, const float *bias, const int32_t *topk_idx,
                                const float *grad_topk_w, float grad_aux_loss, float grad_z_loss,
                                float *grad_logits) {
  static const char fn[] = "epx_route_backward";
  epx_status_t status;
  epx_route_config_t full;
  epx_error_clear();
  if ((status = route_check_config(fn, config, &full)) != EPX_SUCCESS ||
      (status = route_check_tokens(fn, num_tokens)) != EPX_SUCCESS)
    return status;
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
  const epx_backend_t *backend = epx_backend_for_device(config->device);
  if (!backend) return epx_backend_missing(fn, config->device);
  return backend->route_backward(config, num_tokens, logits, bias, topk_idx, grad_topk_w,
                                 grad_aux_loss, grad_z_loss, grad_logits);
}
