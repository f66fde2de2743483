/* Which ranks share a node: the comm's node arrays (core/transport.h), from
 * the config's ranks_per_node, from a key per host that the transport gives
 * (gathered once), or one node; and the public query. */
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "core/error.h"
#include "core/registry.h"

epx_status_t epx_comm_config_ranks_per_node(const char *caller, const epx_comm_config_t *config,
                                            int32_t *ranks_per_node) {
  epx_comm_config_t full;
  epx_status_t status = epx_comm_config_full(caller, config, &full);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(full.ranks_per_node >= 0,
              "%s: config->ranks_per_node is %d; pass the ranks each posed node holds (> 0), or 0 "
              "to take the nodes as the transport finds them", caller, full.ranks_per_node);
  *ranks_per_node = full.ranks_per_node;
  return EPX_SUCCESS;
}

void epx_comm_topology_free(epx_comm_t comm) {
  free(comm->node_of);
  comm->node_of = comm->local_of = comm->node_ranks = comm->node_first = NULL;
}

/* node_of is filled; the rest follows from it. */
static void derive(epx_comm_t comm) {
  int32_t W = comm->size, G = 0;
  for (int32_t r = 0; r < W; r++) G = comm->node_of[r] + 1 > G ? comm->node_of[r] + 1 : G;
  comm->num_nodes = G;
  for (int32_t n = 0; n <= G; n++) comm->node_first[n] = 0;
  for (int32_t r = 0; r < W; r++) comm->node_first[comm->node_of[r] + 1]++;
  for (int32_t n = 0; n < G; n++) comm->node_first[n + 1] += comm->node_first[n];
  int32_t size0 = comm->node_first[1];
  comm->ranks_per_node = size0;
  for (int32_t n = 0; n < G; n++)
    if (comm->node_first[n + 1] - comm->node_first[n] != size0) comm->ranks_per_node = 0;
  for (int32_t r = 0; r < W; r++) {
    int32_t n = comm->node_of[r], at = comm->node_first[n];
    while (comm->node_ranks[at] >= 0) at++;
    comm->node_ranks[at] = r;
    comm->local_of[r] = at - comm->node_first[n];
  }
}

/* Nodes numbered by their lowest rank: keys[r]'s node is the number of
 * distinct keys among the ranks before the first rank holding it. */
static void number_keys(epx_comm_t comm, const int64_t *keys) {
  int32_t next = 0;
  for (int32_t r = 0; r < comm->size; r++) {
    int32_t first = 0;
    while (keys[first] != keys[r]) first++;
    comm->node_of[r] = first == r ? next++ : comm->node_of[first];
  }
}

epx_status_t epx_comm_topology_init(epx_comm_t comm, const char *caller, int32_t ranks_per_node,
                                    const int64_t *host_key) {
  int32_t W = comm->size;
  if (ranks_per_node > 0 && W % ranks_per_node != 0)
    return epx_error(EPX_ERROR_INVALID_ARGUMENT,
                     "%s: config->ranks_per_node is %d, which does not divide the comm's %d ranks; "
                     "pass a divisor of the size, or 0", caller, ranks_per_node, W);
  int32_t *arrays = malloc(sizeof(int32_t) * ((size_t)W * 4 + 1));
  int64_t *keys = host_key && ranks_per_node == 0 ? malloc(sizeof(int64_t) * (size_t)W) : NULL;
  if (!arrays || (host_key && ranks_per_node == 0 && !keys)) {
    free(arrays);
    free(keys);
    return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory for the topology of %d ranks", caller, W);
  }
  comm->node_of = arrays;
  comm->local_of = arrays + W;
  comm->node_ranks = arrays + 2 * (size_t)W;
  comm->node_first = arrays + 3 * (size_t)W;
  for (int32_t r = 0; r < W; r++) comm->node_ranks[r] = -1;
  epx_status_t status = EPX_SUCCESS;
  if (keys) {
    status = comm->ops->allgather(comm, caller, host_key, keys, sizeof *keys);
    if (status == EPX_SUCCESS) number_keys(comm, keys);
  } else {
    for (int32_t r = 0; r < W; r++) comm->node_of[r] = ranks_per_node > 0 ? r / ranks_per_node : 0;
  }
  free(keys);
  if (status != EPX_SUCCESS) {
    epx_comm_topology_free(comm);
    return status;
  }
  derive(comm);
  return EPX_SUCCESS;
}

epx_status_t epx_comm_topology(epx_comm_t comm, int32_t *num_nodes, int32_t *ranks_per_node,
                               int32_t *node, int32_t *local_rank) {
  epx_error_clear();
  EPX_REQUIRE(comm, "epx_comm_topology: comm is NULL; pass a comm from epx_comm_create_*");
  epx_comm_t object = epx_registry_get(comm, EPX_OBJECT_COMM);
  if (!object)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "epx_comm_topology: comm is not a live comm (destroyed already?); pass a comm "
                     "from epx_comm_create_* that has not been destroyed");
  if (num_nodes) *num_nodes = object->num_nodes;
  if (ranks_per_node) *ranks_per_node = object->ranks_per_node;
  if (node) *node = object->node_of[object->rank];
  if (local_rank) *local_rank = object->local_of[object->rank];
  return EPX_SUCCESS;
}
