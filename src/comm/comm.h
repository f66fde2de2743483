/* The transports (self, local, mpi, nccl; src/comm) behind the vtable of
 * core/transport.h: their constructors and the comm config. */
#ifndef EPX_COMM_COMM_H
#define EPX_COMM_COMM_H

#include "core/transport.h"
#include "epx.h"

/* A comm allocated, zeroed and registered (timeout set), ready for a
 * transport's init; epx_comm_free unregisters and frees one whose init
 * failed (comm.c). */
epx_status_t epx_comm_new(const char *fn, double timeout_seconds, epx_comm_t *out);
void epx_comm_free(epx_comm_t comm);

/* Transport constructors (fill ops and impl of a zeroed comm). */
epx_status_t epx_comm_init_self(epx_comm_t comm);
epx_status_t epx_comm_init_local(epx_comm_t comm, epx_local_world_t world, int32_t rank);
epx_status_t epx_comm_init_mpi(epx_comm_t comm, const void *mpi_comm);

/* Checks a comm config (NULL = defaults) and gives its timeout. */
epx_status_t epx_comm_config_timeout(const char *caller, const epx_comm_config_t *config,
                                     double *timeout_seconds);

#endif
