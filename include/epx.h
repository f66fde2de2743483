/*
 * epx.h — expert-parallel exchange for Mixture-of-Experts layers.
 *
 * This header is the contract. It routes tokens to their top-k experts,
 * moves them to the ranks that hold those experts, hands each rank its rows
 * grouped by expert, and brings the expert outputs back as a weighted sum —
 * forward and backward — on CPUs (ranks as threads or MPI processes) and on
 * NVIDIA GPUs.
 *
 * Conventions used throughout
 * ---------------------------
 *  - Every call returns an epx_status_t. On failure nothing the caller owns has
 *    been modified (outputs included), and epx_last_error() returns a message
 *    naming the function, the argument and the fix. The library never exits,
 *    aborts or prints.
 *  - Shapes are written [rows, cols], row-major, contiguous. T = tokens on
 *    this rank, H = hidden size, E = experts (global), K = top-k, W = ranks,
 *    E_local = E / W (rank r holds experts [r*E_local, (r+1)*E_local); with
 *    a placement, config.placement, P / W physical experts placed by it).
 *  - Payload tensors (x, recv_x, expert_out, out and their gradients) have the
 *    buffer's dtype, must be 16-byte aligned, and H must be a multiple of 8.
 *    Routing tensors are int32 / float32, 4-byte aligned.
 *  - Memory: on a CPU buffer every pointer is host memory; on a CUDA buffer
 *    every tensor pointer is device memory and every call is asynchronous on
 *    the buffer's stream unless its documentation says it synchronises.
 *  - "Collective" calls must be made by every rank of the comm, in the same
 *    order. A collective call that fails on one rank fails on all of them (the
 *    failing rank's status travels in the call's first message — the count
 *    exchange of epx_dispatch_layout, the first message of a payload call),
 *    so no rank is left waiting — except when the failure happens before the
 *    buffer or comm can even be identified (a NULL buffer, say): that rank
 *    returns at once and its peers time out with EPX_ERROR_TIMEOUT naming it.
 *  - CPU buffers: that first message also says what the call is (which
 *    call, on which buffer and handle — numbered in creation order over the
 *    comm, so equal on every rank — and its shape). Ranks in different
 *    calls, on different buffers or handles, or with shapes the exchange
 *    cannot serve all fail with EPX_ERROR_SHAPE_MISMATCH naming each rank and
 *    what it called, before anything moves, and the comm stays usable.
 *    Nothing a peer sends is used as a size or an index before it is checked
 *    against the shape that peer declared.
 *  - Destroying or releasing NULL is a no-op. Using an object after it was
 *    destroyed or released is detected and refused with
 *    EPX_ERROR_INVALID_HANDLE, even when a new object has since taken its
 *    memory: the values epx_comm_t, epx_buffer_t, epx_handle_t and
 *    epx_recorder_t hold are ids (a slot and a generation), never
 *    dereferenced by the caller or the library, and an id is never given out
 *    twice.
 *  - Sizes: every product of shape arguments (a row's bytes, the rows a
 *    buffer sends and receives, the router's logits) is checked; a product
 *    that does not fit 64 bits is EPX_ERROR_INVALID_ARGUMENT naming the
 *    argument.
 *  - Enum values are only ever added at the end.
 *
 * Thread safety
 * -------------
 *  - A rank's objects (its comm, the buffers over it, their handles and
 *    recorders) are used by one thread at a time: the calls on one rank are
 *    ordered, as the collective calls require anyway. Different ranks' objects
 *    (the threads of a local world) and unrelated objects may be used from
 *    different threads at once.
 *  - epx_route, epx_route_backward, the references, epx_convert and the
 *    *_config_init calls may run on any number of threads at once (what they
 *    share, the CUDA router's memory pool, is locked).
 *  - epx_handle_retain / epx_handle_release are atomic: a handle may be
 *    retained on one thread and released on another, as long as the thread
 *    releasing it holds a reference and no other call uses it at the time.
 *  - Error messages are per thread (epx_last_error), and so is their lifetime.
 *
 * Aliasing
 * --------
 *  - An output never overlaps an input or another output of the same call,
 *    unless the call says so (epx_convert with the same pointer and dtype).
 *    The payload calls refuse the overlaps a caller makes by mistake — an
 *    output that is the same pointer as an input of the call (out ==
 *    expert_out, recv_x == x, ...) is EPX_ERROR_INVALID_ARGUMENT; other
 *    overlaps are not detected and give undefined results.
 *  - Inputs may alias each other.
 *  - Routing arrays (topk_idx, topk_w, locations) are read only during the
 *    call that takes them; the caller may reuse them afterwards.
 *
 * Streams (CUDA buffers and routes)
 * ---------------------------------
 *  - Every call on a CUDA buffer enqueues its work on the buffer's stream
 *    (config.stream at creation, then the last epx_buffer_set_stream; NULL is
 *    the legacy default stream) and returns without waiting, except where its
 *    documentation says it synchronises (epx_dispatch_layout without
 *    worst_case_sizing; epx_handle_recv_rows with it). Inputs must be ready on
 *    that stream and outputs are ready on it when the call's work completes.
 *  - epx_route and epx_route_backward with EPX_DEVICE_CUDA enqueue on the
 *    route config's stream the same way.
 *  - epx_buffer_set_stream orders: work enqueued later, on the new stream —
 *    including the release of handles' device memory allocated on the old
 *    stream — runs after everything already enqueued on the old stream. It
 *    does not order the caller's own work; make the new stream wait for what
 *    produced your inputs.
 *  - Handles keep device memory that is allocated and freed stream-ordered
 *    (cudaMallocAsync / cudaFreeAsync) on the buffer's stream.
 *
 * Backends and their limits
 * -------------------------
 *  - EPX_DEVICE_CPU: any number of ranks over the self, local and MPI
 *    transports; every layout, exchange and dtype; num_experts and top_k up
 *    to the int32 ranges the arguments allow.
 *  - EPX_DEVICE_CUDA (builds with EPX_BUILD_CUDA; else EPX_ERROR_UNSUPPORTED):
 *    buffers over a comm of one rank, or over the W ranks of an NCCL, local
 *    or shm comm (not MPI: EPX_ERROR_UNSUPPORTED naming the comm); num_experts <= 8192 and max_top_k <= 256 (larger
 *    is EPX_ERROR_UNSUPPORTED at epx_buffer_create); routes and recv rows
 *    below 2^31 per call; epx_route on the GPU needs E's scores in one
 *    thread block's shared memory (larger E: EPX_ERROR_UNSUPPORTED naming
 *    the bytes, route on the CPU). The payloads of dispatch, combine and
 *    both backward passes are the CPU backend's bits exactly; grad_w, a dot
 *    product over H summed in another order, agrees to float32 rounding.
 */
#ifndef EPX_H
#define EPX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_VERSION_MAJOR 0
#define EPX_VERSION_MINOR 1
#define EPX_VERSION_PATCH 0
/* The version as one number, major * 10000 + minor * 100 + patch (0.1.0 is
 * 100), as compiled into the header. */
#define EPX_VERSION_CODE (EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 + EPX_VERSION_PATCH)

/* The version of the library actually loaded, as EPX_VERSION_CODE: compare the
 * two to detect a program built against another release's header. */
int32_t epx_version(void);

/* Versioned configs (epx_route_config_t, epx_comm_config_t,
 * epx_buffer_config_t) start with struct_size (sizeof the struct in the
 * header the caller was built with) and version (EPX_CONFIG_VERSION of that
 * header). Fields are only ever added at the end. The library copies the
 * struct_size bytes the caller's struct has over its own defaults, so a
 * program built against an older, smaller struct keeps working and the
 * fields it does not know keep their defaults. A struct_size below 8 (too
 * small to hold struct_size and version) or above the library's own struct
 * (a header newer than the library), or a version outside
 * [1, EPX_CONFIG_VERSION], is EPX_ERROR_INVALID_ARGUMENT.
 * Fill a config with its *_config_init call (which writes only struct_size
 * bytes: pass sizeof the struct you hold) or its EPX_*_CONFIG_INIT macro; the
 * two give the same defaults. */
#define EPX_CONFIG_VERSION 1

/* ------------------------------------------------------------------------ */
/* Status                                                                    */
/* ------------------------------------------------------------------------ */

typedef enum epx_status {
  EPX_SUCCESS = 0,
  EPX_ERROR_INVALID_ARGUMENT = 1, /* a NULL, negative, out-of-range or misaligned argument */
  EPX_ERROR_OUT_OF_MEMORY = 2,
  EPX_ERROR_UNSUPPORTED = 3,      /* a valid request this build or path does not do (dtype, layout, backend) */
  EPX_ERROR_CAPACITY_EXCEEDED = 4,/* a batch larger than the buffer's agreed max_tokens_per_rank, or a recv buffer too small */
  EPX_ERROR_SHAPE_MISMATCH = 5,   /* ranks disagree on hidden, experts, dtype, ... (buffer creation), or on the collective call, buffer, handle or shape of a call */
  EPX_ERROR_INVALID_HANDLE = 6,   /* a handle/buffer/comm/recorder that was released, destroyed, or belongs elsewhere */
  EPX_ERROR_BUSY = 7,             /* the object is still in use (a buffer with live handles) */
  EPX_ERROR_TIMEOUT = 8,          /* a peer did not answer within the comm's timeout; the message names the rank */
  EPX_ERROR_PEER_FAILED = 9,      /* a peer reported an error in a collective call; the message names the rank */
  EPX_ERROR_TRANSPORT = 10,       /* MPI or NCCL returned an error */
  EPX_ERROR_REPLAY_MISMATCH = 11, /* a recorder replay's routing differs from the record */
  EPX_ERROR_CUDA = 12,            /* a CUDA runtime error */
  EPX_ERROR_INTERNAL = 13
} epx_status_t;

/* A static string naming the status ("EPX_ERROR_TIMEOUT"). Never NULL. */
const char *epx_status_string(epx_status_t status);

/* The last error message of the calling thread ("" if none). Valid until the
 * thread's next epx call. Messages look like
 *   "epx_dispatch: recv_x is NULL; pass a [recv_rows, hidden] buffer". */
const char *epx_last_error(void);

/* ------------------------------------------------------------------------ */
/* Numbers                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum epx_dtype {
  EPX_FLOAT32 = 0,
  EPX_BFLOAT16 = 1,
  EPX_FLOAT16 = 2
} epx_dtype_t;

typedef enum epx_device {
  EPX_DEVICE_CPU = 0,
  EPX_DEVICE_CUDA = 1 /* only when built with EPX_BUILD_CUDA; else EPX_ERROR_UNSUPPORTED */
} epx_device_t;

/* Size in bytes of one element (0 for an unknown dtype). */
size_t epx_dtype_size(epx_dtype_t dtype);

/* Converts n elements between dtypes on the host (round to nearest even).
 * dst and src must not overlap unless they are the same pointer with the same
 * dtype. */
epx_status_t epx_convert(epx_dtype_t dst_dtype, void *dst, epx_dtype_t src_dtype,
                         const void *src, int64_t n);

/* Whether this build has the CUDA backend / the MPI transport. */
int epx_has_cuda(void);
int epx_has_mpi(void);

/* ------------------------------------------------------------------------ */
/* Routing: logits[T, E] -> topk_idx[T, K], topk_w[T, K], locations, losses  */
/* ------------------------------------------------------------------------ */
/* Each option below says which setting of DeepSpeed (deepspeed.moe.
 * sharded_moe: top1gating, top2gating, topkgating) or Megatron-core
 * (megatron/core/transformer/moe/router.py, moe_utils.py) it reproduces; the
 * README's "coming from DeepSpeed / Megatron" table maps their arguments. */

typedef enum epx_score_fn {
  EPX_SCORE_SOFTMAX = 0, /* p = softmax(logits) over E, then top-k of p (DeepSpeed; Megatron
                            moe_router_pre_softmax=True) */
  EPX_SCORE_SIGMOID = 1, /* p = sigmoid(logits), each expert independently (Megatron
                            moe_router_score_function="sigmoid", DeepSeek-V3) */
  /* top-k of the logits, then the weights are the softmax of the K chosen
   * logits (Megatron's default, moe_router_pre_softmax=False); groups rank on
   * the logits too. renormalize is then redundant: leave it 0 to match
   * Megatron's rounding. */
  EPX_SCORE_SOFTMAX_AFTER_TOPK = 2,
  EPX_SCORE_SQRT_SOFTPLUS = 3 /* p = sqrt(softplus(logits)) (Megatron "sqrtsoftplus") */
} epx_score_fn_t;

typedef enum epx_queue_order {
  EPX_QUEUE_BY_CHOICE = 0, /* all first choices queue before any second choice (GShard, Tutel,
                              DeepSpeed top2gating) */
  EPX_QUEUE_BY_TOKEN = 1   /* a token's k choices together, tokens in order (DeepSpeed topkgating) */
} epx_queue_order_t;

typedef enum epx_drop_policy {
  EPX_DROP_BY_POSITION = 0,   /* the first C routes of each expert in queue order stay
                                 (drop_policy="position") */
  /* The C routes of each expert with the largest weight before the drop stay
   * (ties: queue order), located in queue order among themselves (Megatron
   * moe_token_drop_policy="probs", which ranks by its routing probs). */
  EPX_DROP_BY_PROBABILITY = 1,
  /* The same, ranked by the raw gate score of the route (p of the expert;
   * softmax-after-top-k: the softmax of the chosen logits), before any
   * renormalisation or scaling (DeepSpeed topkgating drop_policy="probs"). */
  EPX_DROP_BY_SCORE = 2,
  /* The same, ranked by a seeded random priority of each route
   * (config->random_seed; the same on every backend): DeepSpeed's random
   * token selection (top1gating use_rts=True). */
  EPX_DROP_BY_RANDOM_PRIORITY = 3
} epx_drop_policy_t;

typedef enum epx_nonfinite_policy {
  EPX_NONFINITE_ERROR = 0, /* a NaN/Inf logit is refused (EPX_ERROR_INVALID_ARGUMENT naming the
                              first such token); nothing is written. On CUDA this costs one host
                              synchronisation of the stream. */
  EPX_NONFINITE_DROP = 1   /* a token with any NaN/Inf logit gets no experts: its K slots are
                              -1 with weight 0, it is left out of counts and losses, and it is
                              counted in epx_route_output_t.nonfinite_tokens */
} epx_nonfinite_policy_t;

typedef enum epx_capacity_arithmetic {
  /* C = ceil(f32(T/E) * f32(factor * K)) in float32, as torch computes
   * DeepSpeed's _capacity (T=80, E=8, K=1, factor 1.1: C = 11). factor * K
   * is formed in double: the factor is capacity_factor_f64 when set (> 0;
   * DeepSpeed's factor is a Python float, a double: set this field to match
   * it for every K), else the float capacity_factor. */
  EPX_CAPACITY_FLOAT32 = 0,
  /* C = ceil((T*K/E) * capacity_factor_f64) in double, as Megatron's
   * get_capacity computes it in Python (the two differ in about 1% of
   * shapes; the factor is a double here so that 1.1 means Python's 1.1). */
  EPX_CAPACITY_FLOAT64 = 1
} epx_capacity_arithmetic_t;

typedef enum epx_aux_counts {
  /* F_e = every route chosen for e before dropping (Switch; DeepSpeed
   * top1gating/topkgating) */
  EPX_AUX_COUNTS_SELECTED = 0,
  /* F_e = first choices only, f_e = F_e / T (GShard; DeepSpeed top2gating) */
  EPX_AUX_COUNTS_FIRST_CHOICE = 1,
  /* F_e = a plain top-k of the aux scores q that ignores groups and bias
   * (Megatron compute_routing_scores_for_aux_loss) */
  EPX_AUX_COUNTS_PLAIN_TOPK = 2
} epx_aux_counts_t;

typedef struct epx_route_config {
  uint32_t struct_size; /* sizeof(epx_route_config_t) */
  uint32_t version;     /* EPX_CONFIG_VERSION */
  int32_t num_experts;  /* E >= 1 */
  int32_t top_k;        /* 1 <= K <= E */
  epx_score_fn_t score_fn;
  /* Group-limited selection: experts are split into num_groups equal groups
   * (E % num_groups == 0); a group's score is the sum of its
   * group_score_experts best selection scores (default 2, fewer if the group
   * is smaller); the topk_groups best groups are kept and top-k is taken
   * among their experts. num_groups <= 1 disables it. */
  int32_t num_groups;
  int32_t topk_groups;
  /* Selection uses p + bias[e] when the route call gets a bias (aux-loss-free
   * balancing); weights always use p without the bias. */
  int32_t renormalize;    /* 1: w[t,:] = p[t, chosen] / sum(p[t, chosen]) */
  float scaling_factor;   /* w *= scaling_factor (after renormalisation) */
  /* Capacity mode: C by capacity_arithmetic (at least min_capacity); each
   * route gets a location from a running count per expert in queue_order;
   * routes at location >= C (after drop_policy) are dropped: topk_idx = -1,
   * topk_w = 0, location = -1. capacity_mode = 0 is dropless: every route is
   * kept and locations are still written (the rank of the route in its
   * expert's queue); epx_route_agree_capacity then gives DeepSpeed's
   * drop_tokens=False capacity. */
  int32_t capacity_mode;
  float capacity_factor;
  int32_t min_capacity;
  epx_queue_order_t queue_order;
  epx_drop_policy_t drop_policy;
  /* Losses (computed when the output pointers are non-NULL), over the valid
   * tokens (finite logits, not masked out), Tv of them:
   *   aux_loss = aux_loss_coeff * E * sum_e F_e * P_e / D
   *     F_e = routes counted for e by aux_counts (no gradient),
   *     P_e = sum over valid tokens of q[t,e], q = softmax(logits) for the
   *           softmax scores, q = p / sum_e p for sigmoid and sqrt-softplus,
   *     D   = K * Tv^2 (Switch / GShard: E * sum_e f_e * mean q_e with
   *           f_e = F_e / (Tv K)); Tv^2 with EPX_AUX_COUNTS_FIRST_CHOICE;
   *           see aux_loss_sequences and aux_loss_expert_counts
   *   z_loss = z_loss_coeff * mean over valid tokens of logsumexp(logits[t,:])^2 */
  float aux_loss_coeff;
  float z_loss_coeff;
  epx_nonfinite_policy_t nonfinite;
  epx_device_t device; /* where logits and every output live */
  void *stream;        /* cudaStream_t for EPX_DEVICE_CUDA (NULL = default stream) */

  /* ---- Options added for drop-in parity with DeepSpeed and Megatron ---- */
  epx_capacity_arithmetic_t capacity_arithmetic; /* EPX_CAPACITY_FLOAT32 */
  /* The factor as a double: EPX_CAPACITY_FLOAT64's (required there), and
   * EPX_CAPACITY_FLOAT32's when > 0; capacity_factor is then unused. */
  double capacity_factor_f64;
  /* 1: renormalise over the routes that survive the drop instead of the K
   * chosen (DeepSpeed top2gating / topkgating: a token that lost one of its
   * two routes gets weight 1 on the other). Needs renormalize = 1. */
  int32_t renormalize_after_drop;
  /* Experts summed into a group's score; 0 means 2 (DeepSeek-V3). Megatron's
   * group_limited_topk sums top_k / topk_groups. */
  int32_t group_score_experts;
  epx_aux_counts_t aux_counts; /* EPX_AUX_COUNTS_SELECTED */
  /* Sequence-level aux loss (Megatron seq_aux_loss): B > 1 sequences, token t
   * in sequence t % B (Megatron's [seq, batch] token order; T % B == 0); the
   * loss is the mean over sequences of each sequence's aux loss (F and P per
   * sequence, Megatron's S = Tv / B). 0 or 1: the batch-level loss. */
  int32_t aux_loss_sequences;
  /* Global aux loss (Megatron global_aux_loss): F_e are these counts [E]
   * (the global batch's, e.g. summed over ranks with epx_route_sum_counts),
   * D = K * aux_loss_tokens^2 with aux_loss_tokens the global batch's
   * tokens; P stays this rank's. Memory of the config's device; NULL: off. */
  const float *aux_loss_expert_counts;
  double aux_loss_tokens;
  uint64_t random_seed; /* the seed of EPX_DROP_BY_RANDOM_PRIORITY */
  /* Padding mask [T] (uint8, memory of the config's device): 0 = a padding
   * token, which routes nowhere (K slots -1, weight 0) and counts in no loss
   * and no count; NULL: every token is real. Megatron's padding_mask with
   * the other sense (True = padding there). */
  const uint8_t *token_mask;
} epx_route_config_t;

/* The defaults, in field order. num_experts and top_k have none (0 is
 * refused): set them. */
#define EPX_ROUTE_CONFIG_INIT                                                          \
  {                                                                                    \
    sizeof(epx_route_config_t), /* struct_size */                                      \
    EPX_CONFIG_VERSION,         /* version */                                          \
    0,                          /* num_experts: set it */                              \
    0,                          /* top_k: set it */                                    \
    EPX_SCORE_SOFTMAX,          /* score_fn */                                         \
    0,                          /* num_groups: no group-limited selection */           \
    0,                          /* topk_groups */                                      \
    1,                          /* renormalize */                                      \
    1.0f,                       /* scaling_factor */                                   \
    0,                          /* capacity_mode: dropless */                          \
    1.0f,                       /* capacity_factor */                                  \
    0,                          /* min_capacity */                                     \
    EPX_QUEUE_BY_CHOICE,        /* queue_order */                                      \
    EPX_DROP_BY_POSITION,       /* drop_policy */                                      \
    0.0f,                       /* aux_loss_coeff */                                   \
    0.0f,                       /* z_loss_coeff */                                     \
    EPX_NONFINITE_ERROR,        /* nonfinite */                                        \
    EPX_DEVICE_CPU,             /* device */                                           \
    NULL,                       /* stream: the default stream */                       \
    EPX_CAPACITY_FLOAT32,       /* capacity_arithmetic: torch float32 */               \
    0.0,                        /* capacity_factor_f64 */                              \
    0,                          /* renormalize_after_drop */                           \
    0,                          /* group_score_experts: the best 2 */                  \
    EPX_AUX_COUNTS_SELECTED,    /* aux_counts */                                       \
    0,                          /* aux_loss_sequences: batch-level */                  \
    NULL,                       /* aux_loss_expert_counts: no global aux loss */       \
    0.0,                        /* aux_loss_tokens */                                  \
    0,                          /* random_seed */                                      \
    NULL                        /* token_mask: every token real */                     \
  }

/* Fills the first struct_size bytes of *config with EPX_ROUTE_CONFIG_INIT's
 * defaults and sets struct_size (pass sizeof(epx_route_config_t)). For
 * bindings that cannot expand the macro (the Python package uses it). */
epx_status_t epx_route_config_init(epx_route_config_t *config, size_t struct_size);

/* Outputs of epx_route; the caller owns every array. Required: topk_idx,
 * topk_w. Optional (NULL to skip): the rest. */
typedef struct epx_route_output {
  int32_t *topk_idx;      /* [T, K] expert ids, best first; -1 = dropped */
  float *topk_w;          /* [T, K] weights; 0 where dropped */
  int32_t *locations;     /* [T, K] slot in the expert's queue; -1 where dropped */
  int32_t *expert_counts; /* [E] routes chosen per expert before dropping (valid tokens) */
  float *aux_loss;        /* scalar */
  float *z_loss;          /* scalar */
  int32_t capacity;       /* out (host): C in capacity mode, 0 in dropless mode */
  int64_t nonfinite_tokens; /* out (host; CPU only, -1 on CUDA): tokens dropped for NaN/Inf */
} epx_route_output_t;

/* Routes T tokens. logits [T, E] float32; bias [E] float32 or NULL.
 * Not collective (routing is rank-local); T = 0 is valid. */
epx_status_t epx_route(const epx_route_config_t *config, int64_t num_tokens,
                       const float *logits, const float *bias, epx_route_output_t *output);

/* The capacity C that epx_route reports for num_tokens tokens under config
 * (its capacity_arithmetic, at least min_capacity; 0 in dropless mode),
 * without routing: e.g. to size a capacity-layout buffer for
 * max_tokens_per_rank. Host only, not collective. */
epx_status_t epx_route_capacity_of(const epx_route_config_t *config, int64_t num_tokens,
                                   int32_t *capacity);

/* Gradient of the route: grad_logits[T, E] (overwritten) from grad_topk_w
 * [T, K] (NULL = zeros) and the loss gradients (scalars, host values; 0 when
 * unused). The selection is recomputed from logits and bias (deterministic);
 * topk_idx is the forward's output, so dropped routes get no gradient.
 * Renormalisation (before or after the drop) and scaling are differentiated;
 * bias, counts and the drop are not. Masked and dropped tokens get zeros. */
epx_status_t epx_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                const float *logits, const float *bias,
                                const int32_t *topk_idx, const float *grad_topk_w,
                                float grad_aux_loss, float grad_z_loss, float *grad_logits);

typedef struct epx_comm *epx_comm_t; /* see Communicators below */

/* The capacity of dropless routing agreed across ranks (collective over
 * comm): *capacity = the largest expert_counts[e] ([E], host memory, this
 * rank's epx_route output) on any rank. This is DeepSpeed's
 * drop_tokens=False (an all-reduce MAX of the per-expert counts); the
 * dropless locations are then all below it, so the routing feeds the capacity
 * layout. A separate call because epx_route is rank-local and has no comm. */
epx_status_t epx_route_agree_capacity(epx_comm_t comm, int32_t num_experts,
                                      const int32_t *expert_counts, int32_t *capacity);

/* Sums per-expert counts over the ranks of comm (collective): global [E] =
 * sum over ranks of local [E] (host memory), in rank order; with the tokens'
 * total it feeds the global aux loss (config->aux_loss_expert_counts). */
epx_status_t epx_route_sum_counts(epx_comm_t comm, int32_t num_experts, const int32_t *local,
                                  float *global);

/* ------------------------------------------------------------------------ */
/* Communicators                                                             */
/* ------------------------------------------------------------------------ */

typedef struct epx_comm *epx_comm_t;
typedef struct epx_local_world *epx_local_world_t;

typedef struct epx_comm_config {
  uint32_t struct_size;
  uint32_t version;
  /* Bound on every wait for a peer. A peer that does not arrive in time turns
   * into EPX_ERROR_TIMEOUT naming it; the comm is then failed and every later
   * collective call on it returns EPX_ERROR_PEER_FAILED. <= 0: wait forever. */
  double timeout_seconds;
  /* Which ranks share a node (see epx_comm_topology). 0: as the transport
   * finds it (MPI: MPI_Comm_split_type shared; NCCL: the host's name; threads
   * and shm: one node). N > 0: ranks [0, N) are node 0, [N, 2N) node 1, ...
   * whatever the machine, so that one host can pose as several nodes (tests,
   * byte counts); the comm's size must be a multiple of N. */
  int32_t ranks_per_node;
} epx_comm_config_t;

#define EPX_COMM_CONFIG_INIT                                                           \
  {                                                                                    \
    sizeof(epx_comm_config_t), /* struct_size */                                       \
    EPX_CONFIG_VERSION,        /* version */                                           \
    60.0,                      /* timeout_seconds */                                   \
    0                          /* ranks_per_node: as the transport finds it */         \
  }

/* Fills the first struct_size bytes of *config with EPX_COMM_CONFIG_INIT's
 * defaults and sets struct_size (pass sizeof(epx_comm_config_t)). */
epx_status_t epx_comm_config_init(epx_comm_config_t *config, size_t struct_size);

/* A comm of one rank (no transport). */
epx_status_t epx_comm_create_self(epx_comm_t *comm);

/* The local transport: W ranks as threads of one process sharing memory.
 * Create one world, then each of the W threads calls epx_comm_create_local
 * with its rank (collective over the world). config may be NULL (defaults).
 * The world must outlive its comms; destroy it after every comm is destroyed
 * (EPX_ERROR_BUSY otherwise).
 *
 * CUDA buffers over a local comm (each thread's buffer on its current
 * device: one GPU for every rank, or several GPUs of this process with peer
 * access) run every W-rank CUDA path of an NCCL comm (host, fused,
 * hierarchical, low-latency, fp8) with the same bits, rows moving by
 * cudaMemcpyAsync between the ranks' device memory and the fused kernels'
 * windows being each rank's own memory: for testing an EP layer's real GPU
 * code on one GPU, not for speed (the ranks share the GPU's SMs and memory;
 * each rank's fused kernels take at most its share of the SMs so that all
 * ranks' are resident at once). Set CUDA_DEVICE_MAX_CONNECTIONS to at least
 * W and CUDA_MODULE_LOADING=EAGER before CUDA starts (without eager loading
 * the fused path is refused for ranks sharing a GPU, epx_last_error says
 * why, and the host path serves), and keep device-wide waits
 * (cudaDeviceSynchronize, cudaFree) off a rank's thread while its peers may
 * be inside a fused call it has not reached. The in-process moves of the host, hierarchical and
 * low-latency slab paths cannot be captured in a CUDA graph
 * (EPX_ERROR_UNSUPPORTED); the fused path and the low-latency window can. */
epx_status_t epx_local_world_create(int32_t world_size, const epx_comm_config_t *config,
                                    epx_local_world_t *world);
epx_status_t epx_local_world_destroy(epx_local_world_t world);
epx_status_t epx_comm_create_local(epx_local_world_t world, int32_t rank, epx_comm_t *comm);

/* The MPI transport over a caller's communicator: mpi_comm points to an
 * MPI_Comm. MPI must be initialised. Collective. EPX_ERROR_UNSUPPORTED when
 * built without MPI.
 *  - The library duplicates the communicator (the caller's stays untouched:
 *    only MPI_Comm_idup runs on it) and sets MPI_ERRORS_RETURN on the
 *    duplicate. Every later MPI call of the library is on the duplicate, so
 *    an MPI error — a message longer or shorter than its receive, a failure
 *    the transport notices — comes back as EPX_ERROR_TRANSPORT naming the
 *    peer, whatever handler the caller's communicator has.
 *  - Collectives are point-to-point messages to and from each peer, so the
 *    timeout (EPX_ERROR_TIMEOUT) names the ranks whose messages did not
 *    arrive: a rank that failed before the call, is stuck, or is in another
 *    call. A comm that failed is kept by MPI until the process ends (a few
 *    hundred bytes): its peers may still send to it.
 *  - A process that dies (kill -9, a crash): OpenMPI's mpirun, by default,
 *    then kills every other process of the job, so no call returns at all;
 *    nothing in a library can change that. Under a runtime that lets the
 *    survivors live (OpenMPI's `mpiexec --enable-recovery`, ULFM), their
 *    next collective returns EPX_ERROR_TIMEOUT naming the dead rank (or
 *    EPX_ERROR_TRANSPORT, where MPI reports the loss first), within the
 *    comm's timeout. */
epx_status_t epx_comm_create_mpi(const void *mpi_comm, const epx_comm_config_t *config,
                                 epx_comm_t *comm);

/* The shm transport: W ranks as processes of one host (launched by torchrun,
 * mpirun or anything else), meeting in POSIX shared memory; no MPI needed.
 * Every rank calls it with the same `name` (1 to 200 characters of
 * [A-Za-z0-9._-], unique to the job and new for every comm: rank 0 picks it
 * and tells the others, e.g. through torch.distributed's store), its rank and
 * the world size. Collective. Rank 0 creates the segment /dev/shm/<name>; the
 * others wait for it up to config->timeout_seconds (EPX_ERROR_TIMEOUT naming
 * rank 0). Every wait on a peer is bounded and names the rank that did not
 * arrive, as with the local transport.
 *  - Memory: each rank stages what it sends in a segment of its own, the
 *    size of its largest send (the exchange's send rows, about its send
 *    tensors' size); /dev/shm must hold the ranks' segments together
 *    (EPX_ERROR_OUT_OF_MEMORY naming /dev/shm otherwise; docker's default
 *    is 64 MiB, --shm-size raises it). No name is left in /dev/shm once
 *    every rank is past create and each segment's first collective.
 *  - A process that dies: its peers' next collective returns
 *    EPX_ERROR_TIMEOUT naming it within the timeout.
 *
 * CUDA buffers over an shm comm (each process's buffer on its current
 * device: one GPU shared by several processes, e.g. torchrun
 * --nproc_per_node W on a one-GPU machine, where NCCL refuses two ranks on
 * one GPU, or several GPUs of the host) run the W-rank CUDA paths with the
 * bits of an NCCL comm, device memory shared through CUDA IPC (the ipc
 * transport): each rank stages what it sends in device memory of its own
 * that its peers map (cudaIpcOpenMemHandle), and the copies are ordered by
 * interprocess events; the handles meet through the comm's host exchange,
 * so every wait stays bounded and names a rank that died or stopped. For
 * testing and for frameworks launched one process a rank on one GPU, not
 * for speed (two device copies a message, and a host exchange a call).
 *  - Processes sharing a GPU without MPS take turns on it, so kernels that
 *    wait on each other's flags cannot finish: the fused path and the
 *    low-latency load/store window are refused there at epx_buffer_create
 *    (not an error: the host path, or the low-latency slabs, serve the
 *    buffer; epx_buffer_peer_paths reports EPX_PATH_HOST and
 *    epx_last_error() says why). Under MPS, EPX_IPC_FUSED=try in every
 *    rank's environment lets them try (with CUDA_MODULE_LOADING=EAGER).
 *    Processes on distinct GPUs with peer access take the fused path.
 *  - The staging memory grows to a rank's largest group of messages (twice
 *    that: two halves used in turn), lives with the comm and is freed, the
 *    peers' mappings closed, at epx_comm_destroy (collective).
 *  - The host, hierarchical and low-latency slab moves cannot be captured
 *    in a CUDA graph (EPX_ERROR_UNSUPPORTED), as over a local comm.
 *  - A process that dies or stops mid-call: its peers' bounded waits (the
 *    host exchange, epx_handle_recv_rows, the buffer's destroy) return an
 *    error naming its rank within the timeout (EPX_ERROR_PEER_FAILED once
 *    its process is seen gone, EPX_ERROR_TIMEOUT for one stopped or
 *    stuck). */
epx_status_t epx_comm_create_shm(const char *name, int32_t rank, int32_t size,
                                 const epx_comm_config_t *config, epx_comm_t *comm);

/* The NCCL transport (builds with EPX_BUILD_CUDA and NCCL; else every call
 * below returns EPX_ERROR_UNSUPPORTED and epx_has_nccl() is 0). One process
 * per GPU; CUDA buffers over such a comm exchange on the GPU with NCCL's
 * host API on the buffer's stream. epx_nccl_unique_id_t holds the bytes of
 * an ncclUniqueId.
 *
 * One NCCL per process: libepx links libnccl.so.2 dynamically, so where
 * PyTorch (or the caller) already loaded an NCCL the loader gives epx that
 * same library. The build looks for NCCL in EPX_NCCL_ROOT, Python's
 * nvidia-nccl package, then the CUDA toolkit.
 *
 * Errors and hangs: every host wait on an NCCL comm polls the stream and
 * ncclCommGetAsyncError; an NCCL error becomes EPX_ERROR_TRANSPORT with
 * NCCL's message, and no completion within timeout_seconds becomes
 * EPX_ERROR_TIMEOUT. Either way the NCCL comm is aborted (ncclCommAbort, which
 * also stops its kernels on the GPU; a caller's ncclComm_t too: do not use or
 * destroy it afterwards) and every later call on the epx comm returns
 * EPX_ERROR_PEER_FAILED. NCCL does not say which peer stopped, so the
 * messages name this rank and the comm's size only. Work enqueued on a
 * stream is only watched while epx waits on it: wait through epx (the
 * layout, epx_handle_recv_rows) or bound your own waits.
 *
 * On a CUDA buffer over W > 1 ranks: every collective call first agrees its
 * host verdict over the comm (one small all-gather of each rank's call,
 * buffer, handle, grad_w and verdict: ranks in different calls fail with
 * EPX_ERROR_SHAPE_MISMATCH), as on the CPU, and the layout waits once for the
 * message sizes. With worst_case_sizing none of
 * that happens (the calls can be captured in a CUDA graph): messages have
 * their per-peer bound as size, an oversize batch is refused on its own rank
 * (which still joins the routing exchange, so its peers' layouts complete and
 * report it from epx_handle_recv_rows), and any other host refusal on one rank
 * reaches its peers as EPX_ERROR_TIMEOUT of their next bounded wait. Every
 * rank must use the same routing.top_k and routing.weighting (a different
 * weighting is EPX_ERROR_SHAPE_MISMATCH on every rank: at the layout, or with
 * worst_case_sizing from epx_handle_recv_rows). */
int epx_has_nccl(void);
typedef struct epx_nccl_unique_id {
  char bytes[128];
} epx_nccl_unique_id_t;
/* A fresh id (on one rank; share it with the others, then every rank calls
 * epx_comm_create_nccl_id). */
epx_status_t epx_nccl_get_unique_id(epx_nccl_unique_id_t *id);
/* Collective: creates its own ncclComm_t of `size` ranks on the current CUDA
 * device. */
epx_status_t epx_comm_create_nccl_id(const epx_nccl_unique_id_t *id, int32_t rank, int32_t size,
                                     const epx_comm_config_t *config, epx_comm_t *comm);
/* Over a caller's ncclComm_t (passed as void *; the caller keeps ownership
 * and must keep it alive longer than the comm). */
epx_status_t epx_comm_create_nccl(void *nccl_comm, const epx_comm_config_t *config,
                                  epx_comm_t *comm);
/* For C programs under mpirun: rank 0 makes the id, MPI shares it over
 * *mpi_comm (an MPI_Comm), every rank creates the NCCL comm (collective). */
epx_status_t epx_comm_create_nccl_mpi(const void *mpi_comm, const epx_comm_config_t *config,
                                      epx_comm_t *comm);

/* Collective for local, MPI and NCCL comms (a barrier then release). A failed comm
 * (after a timeout or a peer's failure) is released without synchronising.
 * Once accepted, destroy always releases this rank's comm; it is refused
 * (EPX_ERROR_BUSY) while buffers created over the comm are alive. */
epx_status_t epx_comm_destroy(epx_comm_t comm);
epx_status_t epx_comm_rank(epx_comm_t comm, int32_t *rank);
epx_status_t epx_comm_size(epx_comm_t comm, int32_t *size);
/* Which ranks share a node (rank-local, no communication): the comm's nodes,
 * the ranks of each node (0 when nodes differ in size), this rank's node and
 * its index among its node's ranks. Nodes are numbered in the order of their
 * lowest rank; a node's ranks are indexed in ascending rank order. Combine
 * sums in this order (epx_combine_precision_t) and the hierarchical exchange
 * moves rows along it. Any pointer may be NULL. */
epx_status_t epx_comm_topology(epx_comm_t comm, int32_t *num_nodes, int32_t *ranks_per_node,
                               int32_t *node, int32_t *local_rank);

/* The caller's own collectives over the comm's transport, for the program
 * around the exchange (aligning ranks before a timed region, gathering
 * results); they are bounded by the comm's timeout like every wait on a peer.
 * Collective: every rank calls them in the same order as its other collective
 * calls on the comm. epx_comm_allgather: send [bytes] from every rank lands
 * in recv [size, bytes], block s from rank s (recv must not overlap send). */
epx_status_t epx_comm_barrier(epx_comm_t comm);
epx_status_t epx_comm_allgather(epx_comm_t comm, const void *send, void *recv, size_t bytes);

/* Shrink and go on: after a rank is lost (a call on comm returned
 * EPX_ERROR_TIMEOUT or EPX_ERROR_PEER_FAILED naming it), each survivor
 * calls epx_comm_shrink on the failed comm and gets *survivor_comm, a new
 * comm of the survivors renumbered in ascending old rank order (old rank r
 * becomes the number of survivors below r), and the lost old ranks
 * (lost_ranks, ascending, room for the comm's size; *num_lost; either may be
 * NULL). Collective over the survivors; comm stays failed (destroy it, and
 * the buffers over it, afterwards; a destroy of a failed comm does not
 * synchronise).
 *  - Which ranks are lost is agreed, not guessed by each survivor: the
 *    survivors meet in the transport's shared state (the local world; the
 *    shm segment they all still map), where the first failure's record
 *    lives. The survivors do not wait for a rank that failure named missing,
 *    a rank whose comm is destroyed, or (shm) a rank whose process has
 *    ended; they wait for every other rank up to the old comm's timeout.
 *    The ranks that have called epx_comm_shrink when nobody is left to wait
 *    for (or when a survivor's wait runs out) are the survivors, and every
 *    survivor reads the same record: they all get the same comm and the
 *    same lost_ranks. A rank that calls it later (it was only slow) is
 *    refused with EPX_ERROR_PEER_FAILED: it is not in the survivors' comm.
 *  - Calling it on a comm that has not failed fails it (its other ranks'
 *    calls return EPX_ERROR_PEER_FAILED, and they shrink too): every rank
 *    that joins in time is kept.
 *  - config: the new comm's timeout and posed nodes (NULL: the old comm's
 *    timeout, one node); the same on every survivor. The survivors'
 *    ranks_per_node must divide their number.
 *  - Transports: local (threads: the survivors' world is made by the
 *    shrink and freed with its last comm; epx_local_world_destroy of the
 *    old world once its comms are destroyed, the lost ranks' included) and
 *    shm (processes: the survivors' segment is named "<name>.g<N>", from
 *    the old name and generation, created by the new rank 0, so nothing a
 *    dead process left in the old segment can block it; every wait is
 *    bounded and names ranks as epx_comm_create_shm's) and NCCL
 *    (ncclCommShrink, NCCL 2.27+, looked up in the loaded NCCL at run
 *    time: NCCL_SHRINK_ABORT after a failure or a lost rank, else
 *    NCCL_SHRINK_DEFAULT; the new comm is split and warmed as a created
 *    one, bounded by config's timeout). A failure of an NCCL comm epx
 *    created revokes it (ncclCommRevoke, 2.28) rather than aborting it, so
 *    that it can shrink. NCCL does not name the lost rank: the lost ranks
 *    are the peers of the caller's host whose process has ended. Refused
 *    by name (EPX_ERROR_UNSUPPORTED): a failed NCCL comm with a peer on
 *    another host, one over the caller's ncclComm_t (aborted at the
 *    failure), an NCCL without ncclCommShrink; MPI comms (no ULFM,
 *    MPIX_Comm_shrink, in this build); a self comm (epx_comm_create_self:
 *    it has no peer to lose).
 * Then epx_placement_shrink re-plans the experts over the survivors (see
 * "Expert placement and replicas"). A decode loop on CPU buffers over a
 * local or shm comm may instead mask the lost rank and go on with the same
 * comm and buffer (epx_ll_mask_rank, "Low-latency decode"). */
epx_status_t epx_comm_shrink(epx_comm_t comm, const epx_comm_config_t *config,
                             epx_comm_t *survivor_comm, int32_t *lost_ranks, int32_t *num_lost);

/* ------------------------------------------------------------------------ */
/* Buffers, handles and the exchange                                         */
/* ------------------------------------------------------------------------ */

typedef struct epx_buffer *epx_buffer_t;
typedef struct epx_handle *epx_handle_t;
typedef struct epx_recorder *epx_recorder_t;

typedef enum epx_exchange {
  EPX_EXCHANGE_DEDUP = 0,      /* one row per (token, destination rank); the receiver expands */
  EPX_EXCHANGE_COLLECTIVE = 1, /* one row per (token, selected expert) */
  /* One row per (token, destination node) over the network, to the rank of
   * the same local index there, which forwards it to the node's ranks that
   * hold the token's experts; combine mirrors it (the node's partials summed
   * on that rank, one row home per node). Needs nodes of equal size
   * (epx_comm_topology). The rank-major layout's combine and the passes
   * that return one value or row per route (grad_w, weights_backward) move
   * as the dedup exchange does (a CUDA buffer: the passes with grad_w and
   * weights_backward through its flat host path).
   * CUDA buffers over several ranks plan the hops from the routing read back
   * at the layout, so worst_case_sizing, fp8_format and low_latency are
   * refused with it in this version. */
  EPX_EXCHANGE_HIERARCHICAL = 2,
  /* EPX_EXCHANGE_HIERARCHICAL when the comm spans several nodes of equal size
   * with more than one rank each and the buffer is a CPU one; otherwise
   * EPX_EXCHANGE_DEDUP (a CUDA buffer takes the hierarchical exchange only
   * when config.exchange names it). Resolved once, at epx_buffer_create. */
  EPX_EXCHANGE_AUTO = 3
} epx_exchange_t;

typedef enum epx_layout {
  /* recv_x [N, H]: a row per (source token, local expert), grouped by local
   * expert in ascending order, inside a group by (source rank, source token);
   * each group padded with zero rows to a multiple of expert_alignment. */
  EPX_LAYOUT_EXPERT_MAJOR = 0,
  /* recv_x [N, H]: a row per (source rank, source token) that chose at least
   * one local expert, by source rank then token; the row's local experts come
   * from epx_handle_recv_routing ([N, K], -1 elsewhere). The expert computes
   * each row's own weighted sum over its local experts, so weighting must be
   * EPX_WEIGHTS_NONE in this layout. Its rows have a slot per k, so every
   * rank's routing must have the same top_k (pad with -1): a layout with
   * different top_k is refused on every rank with EPX_ERROR_SHAPE_MISMATCH. */
  EPX_LAYOUT_RANK_MAJOR = 1,
  /* recv_x [E_local, W * C, H]: route (s, t, k) of local expert e, with
   * capacity location l < C from its source rank s, lands at row
   * e * W * C + s * C + l. Unfilled slots are zero. Needs routing.locations. */
  EPX_LAYOUT_CAPACITY = 2
} epx_layout_t;

/* How combine forms a token's sum over ranks. P(t, r) is the token's partial
 * sum on rank r: 0 + w[t,k] * expert_out(t,k) over its k-slots on r, in k
 * order, in float32 (w = 1 unless EPX_WEIGHTS_IN_COMBINE). Then
 * out[t] = round(P'(t, r0) + P'(t, r1) + ...) over the token's ranks in
 * ascending order, summed in float32 from the first partial, rounded once to
 * the payload dtype, where P' is P itself or P rounded once to the payload
 * dtype (tokens without routes get zeros). On a comm of several nodes with
 * more than one rank each (epx_comm_topology) the sum has two levels: each
 * node's Q(t, n) = P'(t, r0) + P'(t, r1) + ... over its ranks in ascending
 * order, Q' = Q or Q rounded once as P' is, then out[t] = round(Q'(t, n0) +
 * Q'(t, n1) + ...) over the nodes in ascending order — on one node, or one
 * rank per node, this is the sum above. (CUDA buffers in this version sum in
 * two levels on the hierarchical exchange only; their dedup and collective
 * exchanges sum in one level on every comm, so over nodes of several ranks
 * those bits may differ from a CPU buffer's.) Every partial is formed
 * the same way whichever exchange moves it, the token's own rank's too: the
 * dedup exchange sums a pair's rows on the expert's rank and sends P' (over
 * MPI; on the local transport the token's rank reads the rows in place), the
 * collective exchange brings each route's row home and forms and rounds the
 * same P' there — so both exchanges give identical bits in both modes. The
 * backward passes are unaffected: dispatch_backward sums the copies'
 * gradients with float32 partials whatever this says, and
 * combine_backward's rows and grad_w are exact products. For float32
 * payloads both modes are the same. Part of the buffer config that every
 * rank must agree on. */
typedef enum epx_combine_precision {
  /* P' = P, float32: the default, because it is the most accurate and costs
   * nothing on the local transport (no partial travels; rows are read in
   * place); combine equals the dense float32 reference to one rounding. A
   * dedup partial over MPI is then twice the bytes of a 16-bit row. */
  EPX_COMBINE_PARTIALS_FLOAT32 = 0,
  /* P' = P rounded once to the payload dtype (DeepEP's bytes: a partial
   * costs one payload row), then summed in float32 as above: at most one
   * more rounding per rank for tokens spread over several ranks; tokens on
   * one rank get the same bits as FLOAT32. */
  EPX_COMBINE_PARTIALS_PAYLOAD = 1
} epx_combine_precision_t;

/* How a CUDA buffer over several ranks moves rows to each peer. */
typedef enum epx_exchange_path {
  /* The faster path for the buffer as measured on 2 H200: the fused NVLink
   * kernels for the rank-major layout; NCCL's host API for the expert-major
   * and capacity layouts (their fused exchanges are faster alone, but a
   * whole training step, exchanges beside the expert GEMMs, measured the
   * same on both paths, and the host path needs no symmetric window) and
   * for everything EPX_PATH_FUSED cannot serve; the same rule for a
   * buffer with an fp8_format. The figures behind the choice:
   * bench/NOTES-gpu.md, "The SM budget: whole steps". */
  EPX_PATH_AUTO = 0,
  /* NCCL's host API for every peer (to compare the paths on the same GPUs,
   * or where the fused window's memory is not wanted). */
  EPX_PATH_HOST = 1,
  /* As a config value: the fused NVLink kernels wherever they can serve the
   * buffer, expert-major and capacity included; the host path where they
   * cannot.
   * Reported by epx_buffer_peer_paths for a peer the fused kernels serve.
   *
   * The fused kernels (src/cuda/fused/fused.h: senders store rows straight into
   * the peers' memory through NCCL 2.28's device API) serve a buffer when
   * the exchange is EPX_EXCHANGE_DEDUP (any layout; the capacity layout's
   * slots are validated and claimed on the GPU as on the host path) and
   * the build has the fused module. The choice is per peer and automatic:
   * the peers this rank reaches by load/store (its NVLink domain, NCCL's
   * LSA team) are served by the fused kernels, the others (other nodes,
   * PCIe without P2P) by NCCL's host API inside the same calls (the fused
   * kernels leave those peers' rows, records, partials and values in an
   * outbox, and grouped ncclSend/ncclRecv on the buffer's stream move them
   * between the kernels, with each peer's bound of max_tokens_per_rank rows
   * as size, so nothing waits on the host; about max_tokens_per_rank * H *
   * (8 + dtype size) bytes more per such peer); epx_buffer_peer_paths
   * reports EPX_PATH_FUSED or EPX_PATH_HOST per peer. EPX_PATH_HOST in the
   * config forces the host path for every peer. The paths give the same
   * bits. On the fused path: the fused
   * state (a symmetric window of about W * max_tokens_per_rank * H * (dtype
   * size + 4) bytes; 8 instead of dtype size + 4 for the expert-major and
   * capacity layouts, whose combine stages float32 partials there) is made
   * at buffer creation, or at the first
   * epx_dispatch_layout when max_tokens_per_rank is agreed there;
   * epx_dispatch, epx_combine, both backward passes,
   * epx_weights_backward, and epx_dispatch_fp8 and epx_dispatch_quantize on
   * a buffer with an fp8_format, run the fused kernels (the routing-weight
   * gradients too: each route's value or dot is formed on its expert's
   * rank, in the host path's order, and goes home through the window;
   * epx_dispatch_backward with grad_w sends x to the experts' ranks again
   * for its dots; an fp8 row travels packed with its scales, see
   * fp8_format); the layout is the fused one alone (counts, every rank's
   * verdict and the routing exchanged on the GPU), which answers the
   * handle's queries with the host path's values; and epx_buffer_destroy is
   * collective (the window is deregistered). The fused module is built with
   * NCCL's device API (nccl_device.h, NCCL 2.28 or later;
   * -DEPX_BUILD_FUSED=OFF leaves it out) and used only with the NCCL release
   * it was compiled against (the device API's structs change between
   * releases). Where the fused path is refused on any rank (that, no
   * symmetric window, no memory for the window), every rank takes the host
   * path (the ranks agree after each step of the fused state's creation, so
   * one rank's refusal is not a timeout for the others) and
   * epx_last_error() after the call that made the fused state
   * (epx_buffer_create, or the first epx_dispatch_layout) says why, naming
   * the refusing rank, although the call succeeds. A fused kernel's wait on
   * a peer is bounded by 0.9 of the comm's timeout; when one runs out, the
   * next call on the buffer (or its destruction) fails the comm as a
   * host-path timeout does (EPX_ERROR_TIMEOUT naming the peer and the
   * phase; the NCCL comm is aborted), and destroying the buffer then
   * releases the window without a collective call. */
  EPX_PATH_FUSED = 2
} epx_exchange_path_t;

typedef enum epx_weighting {
  EPX_WEIGHTS_IN_COMBINE = 0, /* out[t] = sum_k w[t,k] * expert_out(t,k); combine_backward gives grad_w */
  EPX_WEIGHTS_IN_DISPATCH = 1,/* recv row (t,k) = w[t,k] * x[t]; dispatch_backward gives grad_w */
  EPX_WEIGHTS_NONE = 2        /* weights are neither applied nor differentiated */
} epx_weighting_t;

/* FP8 dispatch formats (epx_dispatch_fp8, epx_dispatch_quantize): rows of
 * e4m3fn bytes (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; largest
 * 448, no infinities, 0x7f / 0xff NaN) with one scale per block of each
 * row's channels; a row's value is e4m3(q) * scale, block by block. The
 * scales of a tensor of R rows are [R, H / block] scale entries, row-major,
 * a row's scales beside its row wherever the row goes. The quantizers are
 * the peers' formulas, bit for bit (epx_quantize; amax = the largest |x| of
 * the block; e4m3 rounding to nearest even, saturating at +-448):
 *  - EPX_FP8_E4M3_F32_128 (DeepEP's per_token_cast_to_fp8): float32 scales
 *    per 128 channels, [R, H/128] float. amax clamped below at 1e-4f,
 *    q = e4m3(x * ((1 / amax) * 448)), scale = amax * (1 / 448), each step
 *    in float32 as eager PyTorch computes it on CUDA (PyTorch on the CPU
 *    divides, amax / 448, which can differ in the last bit; DeepEP's
 *    low-latency kernel stores the same scale but divides, 448 / amax, for
 *    q). A block holding a NaN gets a NaN scale (0x7fffffff) and NaN
 *    values; one holding an infinity an infinite scale, NaN at the infinity
 *    and zeros elsewhere: both dequantize to NaN, as PyTorch's formula gives.
 *  - EPX_FP8_E4M3_UE8M0_128 (DeepEP's use_ue8m0 / DeepGEMM's ceil_to_ue8m0):
 *    the same with the scale rounded up to a power of two, 2^ceil(log2(amax
 *    * (1 / 448))) computed exactly from the bits, q = e4m3(x * 2^-e); stored as
 *    its exponent byte e + 127, four blocks per 32-bit word: [R, H/512]
 *    int32, block 4j+i in byte i (bits 8i..8i+7) of word j — DeepEP's
 *    packed UE8M0 layout. H must be a multiple of 512. Byte 255 (NaN or
 *    infinite scale) decodes to infinity, as DeepEP's per_token_cast_back.
 *  - EPX_FP8_MXFP8 (OCP MX; TransformerEngine's MXFP8 quantizer): e8m0
 *    scales per 32 channels, [R, H/32] uint8, the scale's exponent rounded up
 *    as TransformerEngine rounds it: s = amax * (1 / 448) (float32), the
 *    byte is s's biased exponent plus one unless s is a power of two (0 for
 *    s = 0; subnormal s up to 2^-127 keep byte 0), q = e4m3(x * 2^(127 -
 *    byte)). (The OCP spec's floor(log2(amax)) - 8 would clip the block's
 *    largest values instead.) NaNs are left out of amax and stay NaN; an
 *    infinite amax gives byte 254 and the infinity saturates to +-448; byte
 *    255 decodes to NaN, byte 0 to 2^-127.
 * Hidden sizes must be a multiple of the block (of 512 for UE8M0). */
typedef enum epx_fp8_format {
  EPX_FP8_NONE = 0,           /* the buffer dispatches rows of its dtype only */
  EPX_FP8_E4M3_F32_128 = 1,
  EPX_FP8_E4M3_UE8M0_128 = 2,
  EPX_FP8_MXFP8 = 3
} epx_fp8_format_t;

typedef struct epx_buffer_config {
  uint32_t struct_size;
  uint32_t version;
  epx_device_t device;
  epx_dtype_t dtype;          /* payload dtype */
  int64_t hidden;             /* H, a multiple of 8 */
  int32_t num_experts;        /* E, a multiple of the comm's size */
  int32_t max_top_k;          /* K of any routing used with this buffer (1 <= K <= E) */
  /* Tokens per rank per call. 0: agreed by the first epx_dispatch_layout
   * (all-reduce MAX over ranks, rounded up to max_tokens_rounding), once.
   * Must be equal on every rank. Later larger batches are refused. */
  int64_t max_tokens_per_rank;
  int32_t max_tokens_rounding;
  epx_exchange_t exchange;
  epx_layout_t layout;
  int32_t expert_alignment;   /* expert-major group padding (>= 1) */
  int32_t capacity;           /* C per (expert, source rank), capacity layout only */
  /* CUDA: size outputs for the worst case so that neither dispatch_layout nor
   * dispatch synchronises the host (graph capturable); the valid row count is
   * then read with epx_handle_recv_rows_device. Routing values are then
   * checked on the device without waiting: an invalid route (bad expert id,
   * duplicate, bad capacity location) is dropped (treated as -1), and the
   * next epx_handle_recv_rows (which synchronises) reports it as
   * EPX_ERROR_INVALID_ARGUMENT. */
  int32_t worst_case_sizing;
  void *stream;               /* cudaStream_t for EPX_DEVICE_CUDA */
  epx_combine_precision_t combine_precision;
  epx_exchange_path_t exchange_path; /* EPX_PATH_AUTO, _HOST or _FUSED (CUDA, several ranks) */
  /* CTAs (of 512 threads, about one per SM) the fused kernels run on; 0: the
   * default 32, the fastest whole training step of the SM sweep
   * (bench/NOTES-gpu.md, "The SM budget: whole steps"; fewer SMs leave more
   * to the expert GEMMs beside the exchange but slow the exchange itself).
   * Clamped to the device's SM count. Ignored by the host path. */
  int32_t sm_budget;
  /* The format epx_dispatch_fp8 and epx_dispatch_quantize move rows in
   * (EPX_FP8_NONE: neither is available). dtype stays the dtype of every
   * other payload: epx_dispatch's rows, combine's inputs and outputs (bf16
   * or f32 with an fp8 format) and both backward passes, which never use
   * fp8. CPU buffers and CUDA buffers (the GPU quantizes with the same
   * formulas: the same bytes). Over several ranks a CUDA buffer with an fp8
   * format takes the path exchange_path gives any buffer (EPX_PATH_AUTO's
   * rule included), the host path or the fused kernels: on either, each
   * token's row and its scales travel as one packed row (H + the row's
   * scale bytes, rounded up to 16 bytes: quantized once per token before it
   * leaves, with epx_dispatch_quantize), moved as dispatch moves its rows
   * and unpacked into recv_x_q and recv_scales on arrival: the same bytes on
   * both paths and exchanges. The fused path keeps a staging of
   * max_tokens_per_rank packed rows beside its window (epx_dispatch_quantize
   * quantizes into it; epx_dispatch_fp8's senders gather a row and its
   * scales from x_q and x_scales on the way). */
  epx_fp8_format_t fp8_format;
  /* 1: the low-latency decode mode (see "Low-latency decode" below): the
   * buffer serves the epx_ll_* calls only, max_tokens_per_rank is fixed at
   * creation (0 means EPX_LL_DEFAULT_MAX_TOKENS) and the receive memory is
   * the worst case. 0: the normal calls. */
  int32_t low_latency;
  /* Where the experts live and which replicas serve each one (see "Expert
   * placement" below); read during epx_buffer_create only (the buffer keeps
   * its own copy). NULL: the contiguous map, rank r holds experts
   * [r*E_local, (r+1)*E_local), no replicas — the same bits as a buffer
   * built before this field existed. Part of what every rank must agree
   * on. */
  const struct epx_placement *placement;
} epx_buffer_config_t;

/* The defaults, in field order. hidden, num_experts and max_top_k have none
 * (0 is refused): set them. */
#define EPX_BUFFER_CONFIG_INIT                                                         \
  {                                                                                    \
    sizeof(epx_buffer_config_t),  /* struct_size */                                    \
    EPX_CONFIG_VERSION,           /* version */                                        \
    EPX_DEVICE_CPU,               /* device */                                         \
    EPX_FLOAT32,                  /* dtype */                                          \
    0,                            /* hidden: set it */                                 \
    0,                            /* num_experts: set it */                            \
    0,                            /* max_top_k: set it */                              \
    0,                            /* max_tokens_per_rank: agreed at the first layout */ \
    256,                          /* max_tokens_rounding */                            \
    EPX_EXCHANGE_AUTO,            /* exchange */                                       \
    EPX_LAYOUT_EXPERT_MAJOR,      /* layout */                                         \
    1,                            /* expert_alignment: no padding */                   \
    0,                            /* capacity: capacity layout only */                 \
    0,                            /* worst_case_sizing */                              \
    NULL,                         /* stream: the default stream */                     \
    EPX_COMBINE_PARTIALS_FLOAT32, /* combine_precision */                              \
    EPX_PATH_AUTO,                /* exchange_path */                                  \
    0,                            /* sm_budget: 0 = 32 CTAs */                         \
    EPX_FP8_NONE,                 /* fp8_format */                                     \
    0,                            /* low_latency: the normal mode */                   \
    NULL                          /* placement: the contiguous map */                  \
  }

/* Fills the first struct_size bytes of *config with EPX_BUFFER_CONFIG_INIT's
 * defaults and sets struct_size (pass sizeof(epx_buffer_config_t)). */
epx_status_t epx_buffer_config_init(epx_buffer_config_t *config, size_t struct_size);

/* Creates a buffer over comm (collective). The configs of all ranks are
 * compared; a rank that differs in dtype, hidden, num_experts, max_top_k,
 * max_tokens_per_rank, exchange, layout, expert_alignment, capacity,
 * combine_precision, exchange_path, sm_budget, fp8_format, low_latency or
 * placement (its num_physical, replica_rule, or a hash of its maps) makes every rank fail with
 * EPX_ERROR_SHAPE_MISMATCH
 * naming that rank and value.
 * The comm must outlive the buffer. */
epx_status_t epx_buffer_create(epx_comm_t comm, const epx_buffer_config_t *config,
                               epx_buffer_t *buffer);
/* EPX_ERROR_BUSY (and nothing released) while handles from it are alive.
 * Not collective, except for a buffer on the fused path
 * (epx_buffer_peer_paths reports EPX_PATH_FUSED): every rank of its comm
 * destroys it, in the same order as its other buffers on that path. A CUDA
 * buffer over several ranks with worst_case_sizing first waits for its
 * stream, bounded by the comm's timeout (a transfer no peer will match, left
 * by a refusal its peers could not see, then fails the comm with
 * EPX_ERROR_TIMEOUT instead of hanging epx_comm_destroy). */
epx_status_t epx_buffer_destroy(epx_buffer_t buffer);
/* Agreed tokens per rank (0 until agreed). */
epx_status_t epx_buffer_max_tokens(epx_buffer_t buffer, int64_t *max_tokens_per_rank);
/* Upper bound of any handle's recv rows on this buffer (needs the agreed
 * max_tokens_per_rank): W*maxT*min(K,E_local) + E_local*(alignment-1) for
 * expert-major, W*maxT for rank-major, E_local*W*C for capacity. */
epx_status_t epx_buffer_max_recv_rows(epx_buffer_t buffer, int64_t *rows);
/* Sets the CUDA stream of later calls (CUDA buffers; EPX_ERROR_INVALID_ARGUMENT
 * on a CPU buffer). Work enqueued later on the new stream, handle memory
 * releases included, runs after the work already enqueued on the old one
 * (the new stream waits for an event recorded on the old); see "Streams".
 * Live handles stay valid. */
epx_status_t epx_buffer_set_stream(epx_buffer_t buffer, void *stream);
/* The path of each peer: paths[W] gets EPX_PATH_FUSED or EPX_PATH_HOST per
 * rank of the buffer's comm (this rank's own entry says how its self rows
 * move): on the fused path EPX_PATH_FUSED for the peers reached by
 * load/store and EPX_PATH_HOST for the others (see EPX_PATH_FUSED).
 * EPX_PATH_HOST everywhere on CPU buffers, one-rank buffers and buffers
 * whose config or build rules the fused path out. Not collective. */
epx_status_t epx_buffer_peer_paths(epx_buffer_t buffer, int32_t *paths);

/* The routing a dispatch moves by. The arrays are read during
 * epx_dispatch_layout only (the handle keeps its own copy). */
typedef struct epx_routing {
  int64_t num_tokens;        /* T on this rank, 0 <= T <= max_tokens_per_rank */
  int32_t top_k;             /* K <= buffer's max_top_k; may differ between ranks (not in the rank-major layout) */
  const int32_t *topk_idx;   /* [T, K] expert ids or -1; no duplicates in a row */
  const float *topk_w;       /* [T, K]; may be NULL only with EPX_WEIGHTS_NONE */
  const int32_t *locations;  /* [T, K] capacity slots in [0, C), unique per expert; capacity layout only */
  epx_weighting_t weighting;
} epx_routing_t;

/* Computes the layout of a dispatch and exchanges counts and routing metadata
 * (collective). Returns a handle (refcount 1) that drives epx_dispatch,
 * epx_combine and both backward passes with no further count exchange.
 * recorder may be NULL; see epx_recorder_t for what it changes.
 * On CUDA it synchronises the stream once to learn the row count, unless the
 * buffer has worst_case_sizing. */
epx_status_t epx_dispatch_layout(epx_buffer_t buffer, const epx_routing_t *routing,
                                 epx_recorder_t recorder, epx_handle_t *handle);

/* Moves the payload (collective): x [T, H] -> recv_x [N, H] in the buffer's
 * layout. recv_rows_capacity is the rows recv_x can hold (>= N, see
 * epx_handle_recv_rows; with worst_case_sizing N is the bound until
 * epx_handle_recv_rows has returned the real N, and from then on that many
 * rows are enough: an exact-size recv_x). Calling it again on the same handle is a cached
 * dispatch: only the payload moves. Padding rows and unfilled capacity slots
 * are written with zeros. */
epx_status_t epx_dispatch(epx_buffer_t buffer, epx_handle_t handle, const void *x,
                          void *recv_x, int64_t recv_rows_capacity);

/* Brings expert outputs back (collective): expert_out [N, H] in the recv
 * layout -> out [T, H]. out[t] = sum over the token's ranks r, in ascending r,
 * of P(t, r) = sum over the token's k-slots on r, in k order, of
 * w[t,k] * expert_out(t,k) (w = 1 unless EPX_WEIGHTS_IN_COMBINE), all in
 * float32, rounded once to the dtype (each P(t, r) rounded to the dtype first
 * with EPX_COMBINE_PARTIALS_PAYLOAD; see epx_combine_precision_t):
 * independent of exchange and row order.
 * Tokens with no routes get zeros. */
epx_status_t epx_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out,
                         void *out);

/* Gradient of dispatch (collective): grad_recv_x [N, H] -> grad_x [T, H], the
 * sum of the token's copies' gradients (times w with EPX_WEIGHTS_IN_DISPATCH),
 * in the order of epx_combine with float32 partials (whatever the buffer's
 * combine_precision). With EPX_WEIGHTS_IN_DISPATCH, grad_w [T, K]
 * (may be NULL) gets <grad_recv_x(t,k), x[t]>, which needs x (the forward's
 * input); otherwise x and grad_w must be NULL. grad_w is given on every rank
 * or on none (it changes what is exchanged; a CPU buffer refuses a mix on
 * every rank with EPX_ERROR_SHAPE_MISMATCH). */
epx_status_t epx_dispatch_backward(epx_buffer_t buffer, epx_handle_t handle,
                                   const void *grad_recv_x, void *grad_x, const void *x,
                                   float *grad_w);

/* Gradient of combine (collective): grad_out [T, H] -> grad_expert_out [N, H]
 * (row (t,k) = w[t,k] * grad_out[t] with EPX_WEIGHTS_IN_COMBINE, else
 * grad_out[t]; padding rows zero). With EPX_WEIGHTS_IN_COMBINE, grad_w [T, K]
 * (may be NULL) gets <grad_out[t], expert_out(t,k)> (0 for slots of -1), which
 * needs expert_out (the forward's input); otherwise expert_out and grad_w
 * must be NULL. grad_w is what the router learns from: do not drop it. It is
 * given on every rank or on none, as in epx_dispatch_backward. */
epx_status_t epx_combine_backward(epx_buffer_t buffer, epx_handle_t handle,
                                  const void *grad_out, const void *expert_out,
                                  void *grad_expert_out, float *grad_w);

/* Gradient of routing weights that the expert applied itself (collective):
 * with EPX_WEIGHTS_NONE — always so in the rank-major layout — the expert
 * multiplies its rows by epx_handle_recv_routing's recv_w and computes their
 * gradient, grad_recv_w, in the same shape as recv_w ([N], or [N, K] for
 * rank-major). This brings each route's value home: grad_w [T, K] gets it at
 * the route's source slot, 0 for slots without a route. Use it so the router
 * learns when the weights are applied outside the library. */
epx_status_t epx_weights_backward(epx_buffer_t buffer, epx_handle_t handle, const float *grad_recv_w,
                                  float *grad_w);

/* Row count N of the handle's recv layout (host value). On CUDA with
 * worst_case_sizing this synchronises the stream. */
epx_status_t epx_handle_recv_rows(epx_handle_t handle, int64_t *rows);
/* CUDA: device pointer to the int64 row count, valid while the handle lives. */
epx_status_t epx_handle_recv_rows_device(epx_handle_t handle, const int64_t **rows);
/* Rows per local expert before padding [E_local] (int64), and each group's
 * first row [E_local + 1] (expert-major: padded prefix sums; capacity:
 * e*W*C; rank-major: all 0 but the last, N). Memory of the buffer's device. */
epx_status_t epx_handle_expert_counts(epx_handle_t handle, int64_t *counts, int64_t *offsets);
/* Routing of each received row. Expert-major and capacity layouts: [N] global
 * expert id (-1 for padding / empty slots) and weight. With a placement
 * (config.placement) the ids are physical ones, the counts and offsets of
 * epx_handle_expert_counts are per local physical expert (its slot on this
 * rank, epx_placement_t), and E_local is num_physical / W. Rank-major: [N, K]
 * global ids of the row's local experts (-1 elsewhere) and weights. Either
 * pointer may be NULL. Memory of the buffer's device. */
epx_status_t epx_handle_recv_routing(epx_handle_t handle, int32_t *recv_expert, float *recv_w);
/* Source of each received row [N]: rank and token (-1 for padding). */
epx_status_t epx_handle_recv_source(epx_handle_t handle, int32_t *src_rank, int32_t *src_token);
/* Rows this rank sends to other ranks and receives from them (self excluded)
 * in dispatch, and the payload bytes of each (for benchmarks). */
typedef struct epx_handle_stats {
  int64_t send_rows;
  int64_t recv_rows;
  int64_t send_bytes;
  int64_t recv_bytes;
  int64_t local_rows; /* rows this rank sends to itself */
} epx_handle_stats_t;
epx_status_t epx_handle_stats(epx_handle_t handle, epx_handle_stats_t *stats);
/* The rows this rank sends in a dispatch on the handle by link class: to
 * other ranks of its node (rows it forwards for the hierarchical exchange
 * included) and across node boundaries (epx_comm_topology), with their
 * payload bytes. Combine sends the same rows back (a float32 partial's bytes
 * with EPX_COMBINE_PARTIALS_FLOAT32 on a 16-bit payload). CPU buffers and
 * CUDA buffers over several ranks in this version (EPX_ERROR_UNSUPPORTED
 * otherwise; with worst_case_sizing it waits for the layout's counts). */
typedef struct epx_handle_traffic {
  int64_t same_node_rows;
  int64_t same_node_bytes;
  int64_t other_node_rows;
  int64_t other_node_bytes;
} epx_handle_traffic_t;
epx_status_t epx_handle_traffic(epx_handle_t handle, epx_handle_traffic_t *traffic);

/* Reference counting: retain adds one, release drops one. The caller's
 * references (the layout's, each retain's, each replay's) are counted apart
 * from the library's own (a recorder's): once the caller has released all of
 * its references the handle is refused to it (EPX_ERROR_INVALID_HANDLE) —
 * another release included, which never takes a recorder's reference — and
 * the handle is freed when no recorder holds it either. */
epx_status_t epx_handle_retain(epx_handle_t handle);
epx_status_t epx_handle_release(epx_handle_t handle);

/* ------------------------------------------------------------------------ */
/* Expert placement and replicas (elastic expert parallelism)                */
/* ------------------------------------------------------------------------ */

/* Routing names logical experts [0, E); a buffer moves rows to physical
 * experts [0, P), P >= E, each held by one rank, P / W on every rank. A
 * logical expert served by several physical ones is replicated (DeepSeek's
 * EPLB, vLLM's logical_to_physical_map): its rows are spread over its
 * replicas, so a hot expert's load is shared by several ranks.
 *
 * The placement of a buffer (config.placement, agreed at creation):
 *  - physical_rank[p]: the rank holding physical expert p (NULL: rank
 *    p / (P / W), physical experts numbered rank by rank, as DeepSeek's and
 *    vLLM's maps number them). Each rank holds exactly P / W physical
 *    experts; its local expert s (its slot: the index of
 *    epx_handle_expert_counts, the group of the expert-major and capacity
 *    layouts) is its s-th physical expert in ascending id.
 *  - physical_to_logical[p]: the logical expert p serves; every logical
 *    expert has at least one. A logical expert's replicas are its physical
 *    experts in ascending id.
 *  - replica_rule: how a route (token t of rank s, k-slot k, logical expert
 *    e with n replicas) finds its physical expert:
 *      EPX_REPLICA_ROUND_ROBIN: topk_idx holds logical ids; the route goes
 *        to replica (t + s) mod n of e. The rule depends on the route alone
 *        (not on the exchange, the transport, the device or the other
 *        ranks' routing), so dedup, collective and hierarchical exchanges
 *        see the same physical routing and stay bit-identical; and it
 *        spreads every source's tokens evenly over the replicas, which is
 *        the load model epx_placement_plan balances.
 *      EPX_REPLICA_CALLER: topk_idx holds physical ids [0, P) chosen by the
 *        caller (two replicas of one logical expert in a token's row are a
 *        duplicate).
 * Everything after the layout works on physical experts and is unchanged:
 * combine, both backward passes, cached dispatch, the recorder (its hash is
 * of the caller's topk_idx), the low-latency calls and the fp8 dispatches.
 * The combine order (epx_combine_precision_t) is over the ranks that hold
 * the token's chosen physical experts, so a replicated placement sums a
 * token's partials over other ranks than the contiguous map would: its bits
 * may differ from the contiguous map's in the last place (not between
 * exchanges).
 *
 * CUDA buffers take a placement too, on one GPU and on W ranks (every
 * exchange and path of the normal mode): the table (src/core/placement.h)
 * is uploaded once at epx_buffer_create; at each epx_dispatch_layout one
 * small kernel picks every route's physical expert by the same rule, with
 * the same code as the CPU backend, so a CUDA buffer's counts, layouts,
 * recv rows, recv routing (physical ids), combine output and load counts
 * are the CPU backend's bits on the same inputs. With the contiguous map
 * that kernel only counts the load. A low-latency CUDA buffer
 * (config.low_latency) takes the contiguous map only: any other placement
 * is EPX_ERROR_UNSUPPORTED at epx_buffer_create naming config.placement and
 * config.low_latency, never a wrong result. Not yet run on a GPU in this
 * version (README, "Elastic expert parallelism"). On CUDA buffers a
 * capacity layout's locations are checked unique per physical expert (on
 * CPU buffers per routing id), so two routes to one logical expert's two
 * replicas with one location are refused on the CPU only. */
typedef enum epx_replica_rule {
  EPX_REPLICA_ROUND_ROBIN = 0,
  EPX_REPLICA_CALLER = 1
} epx_replica_rule_t;

typedef struct epx_placement {
  int32_t num_physical;               /* P: >= num_experts, a multiple of the comm's size */
  const int32_t *physical_to_logical; /* [P] in [0, num_experts), every logical expert at least once */
  const int32_t *physical_rank;       /* [P] in [0, W), P / W each; NULL: p / (P / W) */
  epx_replica_rule_t replica_rule;
} epx_placement_t;

/* Routes per logical expert ([num_experts] int64) this rank gave
 * epx_dispatch_layout and the low-latency dispatches since the buffer's
 * creation or the last reset (reset != 0 zeroes the counts after reading);
 * replayed layouts (a recorder) are not counted again. Rank-local: sum them
 * over the ranks (epx_comm_allgather) to get the load epx_placement_plan
 * takes. A CUDA buffer keeps its counts on the device (counted when each
 * layout is enqueued, a refused layout's valid routes included) and this
 * call copies them back after the buffer's stream's work (a host wait); a
 * low-latency CUDA buffer is EPX_ERROR_UNSUPPORTED in this version. */
epx_status_t epx_buffer_expert_load(epx_buffer_t buffer, int64_t *load, int32_t reset);

/* The planner (not collective, deterministic: the same inputs give the same
 * placement on every rank and run). From the load of each logical expert
 * (load [num_experts] >= 0, e.g. summed epx_buffer_expert_load counts),
 * fills physical_to_logical [num_physical] with a placement of
 * num_physical - num_experts redundant experts over num_ranks ranks, whose
 * physical_rank is the default (p / (num_physical / num_ranks)): DeepSeek's
 * EPLB scheme — expert groups packed onto nodes by load (balanced packing,
 * heaviest first), each node's redundant experts given one at a time to the
 * expert of the largest load per replica, each node's physical experts
 * packed onto its ranks by load — followed by a refinement that swaps
 * physical experts between the heaviest rank and others while that lowers
 * the heaviest rank's load. num_nodes > 1 keeps every replica of a group
 * on one node when num_groups is a multiple of num_nodes (the node-aware
 * plan for a comm over several nodes); otherwise the plan is global.
 * num_groups (>= 1, dividing num_experts) is the router's expert groups (1:
 * none). num_physical must be a multiple of num_ranks, num_ranks of
 * num_nodes, and num_physical / num_nodes >= num_experts / num_nodes. */
epx_status_t epx_placement_plan(const double *load, int32_t num_experts, int32_t num_physical,
                                int32_t num_ranks, int32_t num_nodes, int32_t num_groups,
                                int32_t *physical_to_logical);

/* The load each rank gets under a placement (NULL: the contiguous map) when
 * a logical expert's load is shared equally by its replicas (the
 * round-robin rule's expectation): rank_load [num_ranks]. The skew is
 * max(rank_load) / mean(rank_load). Not collective. */
epx_status_t epx_placement_rank_load(const epx_placement_t *placement, int32_t num_experts, int32_t num_ranks,
                                     const double *load, double *rank_load);

/* Sums a replicated expert's gradients over its replicas (collective over
 * the buffer's comm; host memory; CPU buffers). grads [E_local, count]
 * float32 holds the gradient of each local physical expert (its slot
 * order); afterwards each holds the sum over every replica of its logical
 * expert, in ascending physical id, in float32, so every replica gets the
 * same bits. Experts without replicas are left as they are. */
epx_status_t epx_replica_grad_sum(epx_buffer_t buffer, float *grads, int64_t count);

/* Moves expert weights to a new placement (collective over comm; host
 * memory). src [P_from / W, block_bytes] holds this rank's physical experts
 * under `from` (slot order), dst [P_to / W, block_bytes] gets this rank's
 * under `to`: each physical expert of `to` receives the block of its
 * logical expert from the replica of `from` on the same rank if there is
 * one, else from the lowest-numbered replica. NULL is the contiguous map.
 * Both placements must be over num_experts logical experts and the comm's
 * size, the same on every rank; src and dst must not overlap. */
epx_status_t epx_placement_move(epx_comm_t comm, int32_t num_experts, const epx_placement_t *from,
                                const epx_placement_t *to, size_t block_bytes, const void *src, void *dst);

/* Shrink and go on: the placement over the survivors of epx_comm_shrink
 * (not collective; deterministic, so every survivor computes the same).
 * placement (NULL: the contiguous map) is the old buffers' placement of
 * num_experts logical experts over num_ranks ranks; lost_ranks [num_lost]
 * is epx_comm_shrink's. Outputs:
 *  - survivors_physical_to_logical [(num_ranks - num_lost) * P / num_ranks]
 *    (may be NULL): what the survivors hold now, as a placement of the
 *    survivors' comm with the default physical_rank: new rank r's slot s
 *    is the expert its slot s held before. The lost ranks' physical
 *    experts are dropped; every surviving replica is kept here.
 *  - physical_to_logical [num_physical]: the new placement (default
 *    physical_rank, round-robin rule), planned by epx_placement_plan over
 *    the survivors (one node) from load [num_experts] (NULL: uniform) with
 *    num_physical (a multiple of the survivors' number, >= num_experts) and
 *    num_groups; its ranks' blocks go to the survivors that already hold
 *    most of their experts (ascending rank, first best), so the move sends
 *    little.
 *  - missing [num_experts] (may be NULL): 1 for a logical expert that no
 *    survivor holds (every replica was on lost ranks); *num_missing (may be
 *    NULL) counts them.
 * Then: with no expert missing, epx_placement_move(survivor_comm,
 * num_experts, &survivors, &new, ...) brings every survivor its experts'
 * weights (and optimizer state, as part of the block) from the surviving
 * replicas; with some missing, no survivor has them: the caller loads each
 * survivor's experts under the new placement from its checkpoint or model
 * files (a training loop rolls back to its last checkpoint; a decode loop
 * reloads the weights). Then it creates its buffers over survivor_comm
 * with config.placement = the new placement. README: "Recovering from a
 * lost rank". */
epx_status_t epx_placement_shrink(const epx_placement_t *placement, int32_t num_experts, int32_t num_ranks,
                                  const int32_t *lost_ranks, int32_t num_lost, const double *load,
                                  int32_t num_physical, int32_t num_groups, int32_t *survivors_physical_to_logical,
                                  int32_t *physical_to_logical, int32_t *missing, int32_t *num_missing);

/* ------------------------------------------------------------------------ */
/* Activation-checkpoint recorder                                            */
/* ------------------------------------------------------------------------ */

/* One recorder per checkpointed call. In EPX_RECORDER_RECORD mode each
 * epx_dispatch_layout given the recorder appends (handle, a hash of topk_idx)
 * and retains the handle. In EPX_RECORDER_REPLAY mode each one takes the next
 * record in order and returns its handle (retained) with no exchange at all,
 * so the following epx_dispatch is a cached dispatch; past the end of the log
 * it falls back to a full epx_dispatch_layout and counts it. With validate on,
 * the replay hashes topk_idx and a difference is EPX_ERROR_REPLAY_MISMATCH
 * naming the call index; validation is collective (one small message: on a
 * CPU buffer the handshake every call starts with, elsewhere a small
 * all-reduce), so every rank refuses together. On a CUDA buffer the hash is
 * computed on the device and read back (one host synchronisation per
 * validated replay). Received rows are never kept. */
typedef enum epx_recorder_mode {
  EPX_RECORDER_RECORD = 0,
  EPX_RECORDER_REPLAY = 1
} epx_recorder_mode_t;

typedef struct epx_recorder_stats {
  int64_t records;      /* handles in the log */
  int64_t replays;      /* dispatch layouts served from the log */
  int64_t fallbacks;    /* replays past the end of the log */
  int64_t bytes_held;   /* bytes of the handles and metadata it keeps alive */
  int64_t bytes_avoided;/* bytes of received rows not kept (sum of N * H * dtype) */
} epx_recorder_stats_t;

epx_status_t epx_recorder_create(int32_t validate, epx_recorder_t *recorder);
/* Switching to replay rewinds the cursor to the first record. */
epx_status_t epx_recorder_set_mode(epx_recorder_t recorder, epx_recorder_mode_t mode);
epx_status_t epx_recorder_stats(epx_recorder_t recorder, epx_recorder_stats_t *stats);
/* Releases every handle it holds. */
epx_status_t epx_recorder_destroy(epx_recorder_t recorder);

/* ------------------------------------------------------------------------ */
/* FP8 dispatch (see epx_fp8_format_t)                                       */
/* ------------------------------------------------------------------------ */

/* The scales of one row in `format`: *scale_cols entries of *scale_bytes
 * bytes each (H/128 floats, H/512 int32 words, H/32 bytes).
 * EPX_ERROR_INVALID_ARGUMENT for EPX_FP8_NONE, an unknown format, or a hidden
 * that is not a positive multiple of the format's block (the message names
 * the multiple). Host, not collective. */
epx_status_t epx_fp8_scale_shape(epx_fp8_format_t format, int64_t hidden, int64_t *scale_cols,
                                 size_t *scale_bytes);

/* The quantizer of the format, on the host (any number of threads): x [rows,
 * H] of dtype (f32, bf16 or f16) -> x_q [rows, H] e4m3fn bytes and x_scales
 * [rows, scale_cols] (epx_fp8_scale_shape); bit for bit the peers' formula
 * (epx_fp8_format_t). epx_dequantize is its inverse as the peers compute it:
 * x [rows, H] of dtype = round(float32(e4m3(q)) * scale). No alignment
 * needed; outputs must not overlap inputs. */
epx_status_t epx_quantize(epx_fp8_format_t format, epx_dtype_t dtype, int64_t rows, int64_t hidden,
                          const void *x, void *x_q, void *x_scales);
epx_status_t epx_dequantize(epx_fp8_format_t format, epx_dtype_t dtype, int64_t rows, int64_t hidden,
                            const void *x_q, const void *x_scales, void *x);

/* Moves fp8 rows with their scales (collective; the buffer's fp8_format,
 * else EPX_ERROR_INVALID_ARGUMENT): x_q [T, H] e4m3fn bytes and x_scales
 * [T, scale_cols] -> recv_x_q [N, H] and recv_scales [N, scale_cols] in the
 * buffer's layout, each received row's scales in the same row of
 * recv_scales; N and recv_rows_capacity as in epx_dispatch, padding rows and
 * unfilled capacity slots zero in both. The bytes are moved, never
 * recomputed: a row arrives bit for bit as sent, whatever the exchange
 * (dedup and collective give the same bytes). Cached dispatch and recorder
 * replays work as for epx_dispatch. The handle's weighting must not be
 * EPX_WEIGHTS_IN_DISPATCH (fp8 rows are not scaled on the way; apply the
 * weights in combine or in the expert). x_q, recv_x_q 16-byte aligned;
 * x_scales, recv_scales aligned to their entry size. A rank in
 * epx_dispatch_fp8 and another in epx_dispatch or epx_dispatch_quantize is
 * EPX_ERROR_SHAPE_MISMATCH on every rank. Combine, epx_dispatch_backward and
 * epx_combine_backward are unchanged: their rows have the buffer's dtype
 * (bf16 or f32) on an fp8 buffer too; the gradient of a dispatch is taken
 * as that of the dequantized rows (straight through the quantizer). */
epx_status_t epx_dispatch_fp8(epx_buffer_t buffer, epx_handle_t handle, const void *x_q,
                              const void *x_scales, void *recv_x_q, void *recv_scales,
                              int64_t recv_rows_capacity);

/* The same from rows of the buffer's dtype (x [T, H], 16-byte aligned),
 * quantized on the way with epx_quantize's formula, once per token: the
 * received bytes are those of epx_quantize then epx_dispatch_fp8. */
epx_status_t epx_dispatch_quantize(epx_buffer_t buffer, epx_handle_t handle, const void *x,
                                   void *recv_x_q, void *recv_scales, int64_t recv_rows_capacity);

/* ------------------------------------------------------------------------ */
/* Low-latency decode (config.low_latency = 1)                               */
/* ------------------------------------------------------------------------ */

/* A decode step moves 1 to a few hundred tokens per rank, where the normal
 * exchange's separate layout call dominates. A low-latency buffer
 * (config.low_latency = 1, DeepEP's low_latency_dispatch / _combine) has:
 *  - max_tokens_per_rank fixed at creation, the same on every rank (0 in the
 *    config means EPX_LL_DEFAULT_MAX_TOKENS); a step of more tokens is
 *    EPX_ERROR_CAPACITY_EXCEEDED naming max_tokens_per_rank, on every rank;
 *  - fixed worst-case receive tensors, whatever the routing:
 *      EPX_LAYOUT_EXPERT_MAJOR: recv_x [E_local, W * max_tokens, H] (DeepEP's
 *        shape); expert e's rows are the first recv_count[e] rows of its
 *        block, ordered by (source rank, source token) — the rows, in the
 *        order, of the normal expert-major layout;
 *      EPX_LAYOUT_RANK_MAJOR: recv_x [W, max_tokens, H]; the rows from source
 *        rank s are the first recv_count[s] of its block, a row per token of
 *        s that chose a local expert, in token order (the normal rank-major
 *        rows); weighting EPX_WEIGHTS_NONE, as in that layout.
 *    Rows past the counts are not part of the result and are not written
 *    (zeroing the worst case would cost more than the step). expert_alignment
 *    must be 1; the capacity layout is refused;
 *  - one call each way: epx_ll_dispatch makes the layout and moves the rows
 *    (no epx_dispatch_layout), returning the handle that epx_ll_combine
 *    replays. The handle answers the usual queries over the fixed shape:
 *    epx_handle_recv_rows gives N = E_local * W * max_tokens (rank-major
 *    W * max_tokens), epx_handle_recv_source each row's (rank, token) [N]
 *    (DeepEP's src_info; -1 past the counts), epx_handle_recv_routing its
 *    expert and weight, epx_handle_expert_counts the counts and offsets
 *    (expert-major: e * W * max_tokens);
 *  - combine weights in combine (EPX_WEIGHTS_IN_COMBINE: out[t] = the sum of
 *    epx_combine, the same bits: in float32, per rank in k order, ranks
 *    ascending, rounded once to the buffer's dtype) or not at all
 *    (EPX_WEIGHTS_NONE); EPX_WEIGHTS_IN_DISPATCH is refused;
 *  - no backward: epx_dispatch_backward, epx_combine_backward and
 *    epx_weights_backward on it are EPX_ERROR_UNSUPPORTED naming the mode
 *    (decode has none; train on a normal buffer), and so are
 *    epx_dispatch_layout and the normal payload calls (use the epx_ll_*
 *    calls), on every rank together.
 * Bit-identical to the normal exchange with the same config on the same
 * routing: the same rows, in the same order within each expert (or source
 * rank), and the same combine sums.
 *
 * Two phases: epx_ll_dispatch_send / epx_ll_combine_send start the exchange
 * and return; epx_ll_complete(handle) finishes it. Between the two the
 * caller may run other work (attention, the other micro-batch's exchange on
 * another handle); the send's inputs must stay unchanged and its outputs are
 * not ready until complete returns. Every send is completed before the next
 * LL call on the same handle (EPX_ERROR_INVALID_ARGUMENT otherwise, naming
 * the pending call). epx_ll_dispatch, epx_ll_dispatch_fp8 and
 * epx_ll_combine are their _send then complete. On a CPU buffer the whole
 * exchange runs inside the send (the calling thread has nothing to overlap
 * it with; complete only closes it) and, like the normal CPU calls, the
 * dispatch agrees every rank's call and counts in its first message; the
 * rows follow in a second. On one GPU the send enqueues the whole step on
 * the buffer's stream and complete enqueues nothing.
 *
 * Token counts: num_tokens, when not NULL, points to the step's token count
 * (int32, memory of the buffer's device: a device value on a GPU, so that a
 * captured graph replays with new counts; host memory on a CPU buffer, read
 * during the send call); routing->num_tokens is then the rows x and the
 * routing arrays hold (<= max_tokens_per_rank), and *num_tokens must be in
 * [0, routing->num_tokens]. NULL: routing->num_tokens is the count. On a
 * CUDA buffer the handle's T (combine's out rows) is then routing->num_tokens
 * and out's rows past the count are zeros; a count outside [0,
 * routing->num_tokens] is clamped to it.
 *
 * Backends: CPU buffers over any comm, both layouts. CUDA buffers over one
 * rank, expert-major (rank-major: EPX_ERROR_UNSUPPORTED at
 * epx_buffer_create), or over the W ranks of an NCCL, local or shm comm, both layouts
 * (rank-major and fp8 on the NCCL messages below): the calls enqueue on the
 * buffer's stream, never synchronise the host and allocate nothing, so they
 * can be captured in a CUDA graph; routing values are checked on the device,
 * an invalid route (an id outside [0, E), a token's second route to one
 * expert) dropped as with worst_case_sizing; at most 4 handles of a buffer
 * are live at once (EPX_ERROR_BUSY: release one). On W ranks
 * config.exchange_path picks the exchange: EPX_PATH_AUTO and EPX_PATH_FUSED
 * take the fused kernels' window (EPX_PATH_FUSED above: rows stored into the
 * peers' memory, peers without load/store access relayed), where the build
 * and config allow it (expert-major, not an fp8_format) and every rank
 * creates it (epx_buffer_peer_paths says so), and the send then enqueues the
 * whole step; otherwise, and with EPX_PATH_HOST, each step sends every peer
 * one message of the worst case's size over NCCL's host API (max_tokens rows,
 * with the counts and routes in a header after them), the send enqueuing up
 * to those transfers and complete the receiving side (the placement of the
 * rows, or combine's sums). Either gives the normal exchange's bits. As with
 * worst_case_sizing the ranks' host verdicts are not agreed, so a call
 * refused on one rank only reaches its peers as EPX_ERROR_TIMEOUT of their
 * next bounded wait (epx_buffer_destroy's, at the latest). Memory: the slabs
 * hold 4 slots of staging, 2 x W x (max_tokens + header rows) rows each
 * (float32 rows with float32 partials of a 16-bit dtype); the window, the
 * fused state's and W x max_tokens x min(max_top_k, E_local) rows. */
#define EPX_LL_DEFAULT_MAX_TOKENS 256

/* Dispatch of one decode step (collective): x [T, H] -> recv_x (the fixed
 * shape above, 16-byte aligned) and recv_count (int32, [E_local] expert-major
 * or [W] rank-major, memory of the buffer's device; may be NULL), and a new
 * handle (refcount 1; release it with epx_handle_release). routing as for
 * epx_dispatch_layout (its arrays are read during the send only). */
epx_status_t epx_ll_dispatch(epx_buffer_t buffer, const epx_routing_t *routing,
                             const int32_t *num_tokens, const void *x, void *recv_x,
                             int32_t *recv_count, epx_handle_t *handle);
epx_status_t epx_ll_dispatch_send(epx_buffer_t buffer, const epx_routing_t *routing,
                                  const int32_t *num_tokens, const void *x, void *recv_x,
                                  int32_t *recv_count, epx_handle_t *handle);

/* The same in fp8 (DeepEP's use_fp8; a low-latency buffer with an
 * fp8_format; CPU and CUDA buffers): x [T, H] of the buffer's dtype
 * quantized on the way once per token (x_scales NULL; epx_dispatch_quantize's
 * bytes), or x e4m3 bytes with x_scales [T, scale_cols] (epx_dispatch_fp8's)
 * -> recv_x_q (the fixed shape, e4m3 bytes) and recv_scales (the fixed
 * shape's rows, scale_cols each: row-major, epx's fp8 convention, not
 * DeepEP's column-major scales). Each received row and its scales are the
 * normal fp8 dispatch's, in its order. combine takes rows of the buffer's
 * dtype, as ever. */
epx_status_t epx_ll_dispatch_fp8(epx_buffer_t buffer, const epx_routing_t *routing,
                                 const int32_t *num_tokens, const void *x, const void *x_scales,
                                 void *recv_x_q, void *recv_scales, int32_t *recv_count,
                                 epx_handle_t *handle);
epx_status_t epx_ll_dispatch_fp8_send(epx_buffer_t buffer, const epx_routing_t *routing,
                                      const int32_t *num_tokens, const void *x,
                                      const void *x_scales, void *recv_x_q, void *recv_scales,
                                      int32_t *recv_count, epx_handle_t *handle);

/* Combine of the step (collective): expert_out (recv_x's shape; rows past
 * the counts are not read) -> out [T, H], T the dispatch's count. */
epx_status_t epx_ll_combine(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out,
                            void *out);
epx_status_t epx_ll_combine_send(epx_buffer_t buffer, epx_handle_t handle, const void *expert_out,
                                 void *out);

/* Finishes the handle's pending send (dispatch or combine). Every rank
 * completes each of its sends. EPX_ERROR_INVALID_ARGUMENT when nothing is
 * pending on the handle. */
epx_status_t epx_ll_complete(epx_buffer_t buffer, epx_handle_t handle);

/* The active-rank mask (DeepEP's low_latency_update_mask_buffer,
 * low_latency_query_mask_buffer, low_latency_clean_mask_buffer): a decode
 * loop that lost a rank goes on with the same comm and buffer.
 *  - epx_ll_mask_rank(buffer, rank, 1) masks rank: the caller's later
 *    collectives over the buffer's comm complete among the unmasked ranks
 *    without waiting for it, and its calls are refused
 *    (EPX_ERROR_PEER_FAILED). Routes to experts that a masked rank holds
 *    are dropped: recv_x gets no rows there, and combine's out[t] is the
 *    sum over the token's other experts (the weights are not renormalised;
 *    a token whose experts are all masked gets zeros), as in DeepEP. A
 *    replica of a masked rank's expert elsewhere is not substituted.
 *  - After an epx_ll_* call returned EPX_ERROR_TIMEOUT (or
 *    EPX_ERROR_PEER_FAILED) naming the lost rank, each survivor masks it;
 *    once every rank the failure named is masked the comm is no longer
 *    failed, and the survivors' next epx_ll_* call starts a fresh step (the
 *    failed step's outputs and handle are void: release the handle).
 *  - Every survivor masks the same ranks before its next collective call on
 *    the comm (not collective itself: a local call on each rank). The mask
 *    is the comm's: every low-latency buffer over it sees it; a normal
 *    buffer's calls over it are EPX_ERROR_UNSUPPORTED naming the masked
 *    rank (shrink the comm for them).
 *    masked 0 unmasks: the rank takes part again from the next call that
 *    every unmasked rank makes (the caller brings it back in step); a rank
 *    cannot mask itself.
 *  - epx_ll_query_mask: mask [W] (int32, host memory) gets 1 for each
 *    masked rank, 0 otherwise. epx_ll_clean_mask unmasks every rank.
 * Backends: CPU buffers over a local (threads) or shm (processes) comm; a
 * survivor that was outside the comm's barriers while the others masked the
 * failed rank and went on gets the failure at its next call (so every
 * survivor fails the same step), masks, and goes on. Over shm the mask
 * that clears the failure first waits for a survivor still reading the
 * failed call's data (bounded by the comm's timeout: EPX_ERROR_TIMEOUT
 * naming that rank, nothing masked). The
 * mask is the caller's, after the error: no rank is masked on its own.
 * Masking on a CPU buffer over another transport (MPI, NCCL, self) or on a
 * CUDA buffer is EPX_ERROR_UNSUPPORTED naming it: shrink the comm instead
 * (epx_comm_shrink). The query and the clean answer on every low-latency
 * buffer (nothing masked there). */
epx_status_t epx_ll_mask_rank(epx_buffer_t buffer, int32_t rank, int32_t masked);
epx_status_t epx_ll_query_mask(epx_buffer_t buffer, int32_t *mask);
epx_status_t epx_ll_clean_mask(epx_buffer_t buffer);

/* ------------------------------------------------------------------------ */
/* References (plain C, host memory; the oracle of the tests)                */
/* ------------------------------------------------------------------------ */

/* Dense one-hot dispatch, the einsum `sec,sm->ecm`: builds the mask
 * [T, E, C] (1 or w at (t, topk_idx[t,k], locations[t,k])) and computes
 * out[E, C, H] = sum_t mask[t,e,c] * x[t,:] with float32 accumulation.
 * Weighted by topk_w only with EPX_WEIGHTS_IN_DISPATCH. O(T*E*C*H). */
epx_status_t epx_reference_dense_dispatch(epx_dtype_t dtype, int64_t num_tokens, int64_t hidden,
                                          int32_t num_experts, int32_t capacity, int32_t top_k,
                                          const int32_t *topk_idx, const float *topk_w,
                                          const int32_t *locations, epx_weighting_t weighting,
                                          const void *x, void *out);
/* Dense one-hot combine, the einsum `sec,ecm->sm`: out[T, H] = sum_{e,c}
 * mask[t,e,c] * expert_out[e,c,:] (mask weighted with EPX_WEIGHTS_IN_COMBINE). */
epx_status_t epx_reference_dense_combine(epx_dtype_t dtype, int64_t num_tokens, int64_t hidden,
                                         int32_t num_experts, int32_t capacity, int32_t top_k,
                                         const int32_t *topk_idx, const float *topk_w,
                                         const int32_t *locations, epx_weighting_t weighting,
                                         const void *expert_out, void *out);

/* The routing reference: epx_route's spec (src/core/route_spec.h) computed
 * in float64 from the float32 inputs, host memory only (the config's device,
 * stream and memory pointers are read as host memory). Every routing test
 * (CPU, GPU, epx-bench, Python) compares with it: integers exactly, weights
 * and losses to about 1e-5 relative. Outputs as epx_route's, weights and
 * losses in double; any output but topk_idx and topk_w may be NULL;
 * *capacity gets C (0 dropless). Selection near float32 ties may differ from
 * the fast paths'; tests draw inputs away from ties. */
epx_status_t epx_reference_route(const epx_route_config_t *config, int64_t num_tokens,
                                 const float *logits, const float *bias, int32_t *topk_idx,
                                 double *topk_w, int32_t *locations, int32_t *expert_counts,
                                 double *aux_loss, double *z_loss, int32_t *capacity);
/* The gradient of epx_route_backward in float64: grad_logits [T, E] from the
 * forward's topk_idx, grad_topk_w [T, K] (NULL = zeros) and the loss
 * gradients. */
epx_status_t epx_reference_route_backward(const epx_route_config_t *config, int64_t num_tokens,
                                          const float *logits, const float *bias,
                                          const int32_t *topk_idx, const float *grad_topk_w,
                                          double grad_aux_loss, double grad_z_loss,
                                          double *grad_logits);

#ifdef __cplusplus
}
#endif
#endif /* EPX_H */
