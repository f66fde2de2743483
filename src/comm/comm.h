/* The transports (self, local, mpi; src/comm) behind the vtable of
 * core/transport.h: their constructors and the comm config. */
#ifndef EPX_COMM_COMM_H
#define EPX_COMM_COMM_H

#include "core/transport.h"
#include "epx.h"

/* Transport constructors (fill ops and impl of a zeroed comm). */
epx_status_t epx_comm_init_self(epx_comm_t comm);
epx_status_t epx_comm_init_local(epx_comm_t comm, epx_local_world_t world, int32_t rank);
epx_status_t epx_comm_init_mpi(epx_comm_t comm, const void *mpi_comm);

/* Checks a comm config (NULL = defaults) and gives its timeout. */
epx_status_t epx_comm_config_timeout(const char *caller, const epx_comm_config_t *config,
                                     double *timeout_seconds);

#endif
