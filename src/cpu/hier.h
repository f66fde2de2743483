/* The hierarchical exchange on the CPU (hier.c): a dedup plan (layout.c)
 * whose rows travel in two hops. Dispatch sends a token once per other node
 * that holds any of its experts, to the rank of the sender's local index
 * there (the relay), which forwards it to the node's ranks that hold them
 * (hop 2, inside the node, where the token's own node's ranks get it straight
 * from its rank). Combine mirrors it: each receiver's partial P(t, r) goes to
 * the relay, which sums its node's partials in ascending rank order into
 * Q(t, n) and sends one row home per node; the token's rank sums the Q in
 * ascending node order (the contract's two-level sum, epx.h). */
#ifndef EPX_CPU_HIER_H
#define EPX_CPU_HIER_H

#include <stddef.h>
#include <stdint.h>

#include "core/objects.h"
#include "epx.h"

struct epx_cpu_plan;
struct epx_cpu_hier;

/* The two hops' plan, after the flat layout (three more messages: the
 * network rows' counts, their forward masks, the forwarded counts). */
epx_status_t epx_cpu_hier_layout(epx_buffer_t b, struct epx_cpu_plan *p, const char *fn);
void epx_cpu_hier_free(struct epx_cpu_hier *h);

/* Dispatch's rows (src [T, row_bytes]) moved in two hops; item_src[i] points
 * at received item i's row (flat ritem order), valid until the handle's next
 * call. */
epx_status_t epx_cpu_hier_forward(epx_buffer_t b, struct epx_cpu_plan *p, const void *src, size_t row_bytes,
                                  const void **item_src, const char *fn);

/* Combine (and dispatch_backward without grad_w): rows [N, H] of the layout
 * -> out [T, H], weighted by the routes' weights or not, partials rounded to
 * the payload dtype or float32. */
epx_status_t epx_cpu_hier_combine(epx_buffer_t b, struct epx_cpu_plan *p, const void *rows, void *out,
                                  int weighted, int round_partials, const char *fn);

/* acc (+)= a partial row: rounded (payload dtype, taken exactly as it is) or
 * float32 (acc = 0 + row when first). The one way partials are summed, so
 * that the flat and the hierarchical combine agree bit for bit. */
void epx_cpu_add_partial(epx_dtype_t dtype, const void *row, int rounded, float *acc, int first, int64_t n);

/* Dispatch rows by link class (epx_handle_traffic). */
void epx_cpu_traffic(const struct epx_cpu_plan *p, epx_comm_t comm, epx_handle_traffic_t *t);

#endif
