/* The public communicator API: argument checks, the registry of live comms,
 * and the collective destroy. The transports behind comm->ops (self.c,
 * local.c, mpi.c) do the moving; the local world's own create/destroy live in
 * local.c beside the world they build. */
#include "comm/comm.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "core/config.h"
#include "core/error.h"
#include "core/registry.h"

#if !EPX_MPI_PLUGIN /* else mpi_plugin.c says whether the plugin loads */
int epx_has_mpi(void) { return EPX_HAVE_MPI; }
#endif

/* A comm allocated and registered, ready for a transport's init; comm->id
 * is the value the caller will hold (core/registry.h). */
epx_status_t epx_comm_new(const char *fn, double timeout_seconds, epx_comm_t *out) {
  epx_comm_t comm = calloc(1, sizeof *comm);
  if (!comm) return epx_error(EPX_ERROR_OUT_OF_MEMORY, "%s: out of memory allocating a comm", fn);
  comm->timeout_seconds = timeout_seconds;
  void *registered = NULL;
  epx_status_t status = epx_registry_add(comm, EPX_OBJECT_COMM, &registered);
  if (status != EPX_SUCCESS) {
    free(comm);
    return status;
  }
  comm->id = registered;
  *out = comm;
  return EPX_SUCCESS;
}

void epx_comm_free(epx_comm_t comm) {
  epx_comm_topology_free(comm);
  epx_registry_remove(comm->id);
  free(comm->masked);
  free(comm);
}

/* Appends printf text to out [used, size). */
static void comm_append(char *out, size_t size, size_t *used, const char *format, ...)
    __attribute__((format(printf, 4, 5)));
static void comm_append(char *out, size_t size, size_t *used, const char *format, ...) {
  if (*used >= size) return;
  va_list args;
  va_start(args, format);
  int n = vsnprintf(out + *used, size - *used, format, args);
  va_end(args);
  if (n > 0) *used = *used + (size_t)n < size ? *used + (size_t)n : size;
}

/* Whether rank p is listed: flag[p], and not unless[p] (unless may be NULL). */
static int comm_listed(const uint8_t *flag, const uint8_t *unless, int32_t p) {
  return flag[p] && !(unless && unless[p]);
}

/* Appends "rank 3" or "ranks 1, 2" (up to 16 named) of the listed ranks;
 * returns how many there are. */
static int32_t comm_ranks(char *out, size_t size, size_t *used, int32_t ranks,
                          const uint8_t *flag, const uint8_t *unless) {
  int32_t count = 0, named = 0;
  for (int32_t p = 0; p < ranks; p++) count += comm_listed(flag, unless, p);
  comm_append(out, size, used, "rank%s ", count > 1 ? "s" : "");
  for (int32_t p = 0; p < ranks && named < 16; p++)
    if (comm_listed(flag, unless, p)) comm_append(out, size, used, "%s%d", named++ ? ", " : "", p);
  if (count > named) comm_append(out, size, used, ", ... (%d in all)", count);
  return count;
}

void epx_comm_timeout_text(char *out, size_t out_size, int32_t size, const char *op,
                           double timeout, const uint8_t *missing, const uint8_t *waiting,
                           const uint8_t *behind, const uint8_t *also, const uint8_t *also_behind) {
  size_t used = 0;
  int32_t causes = 0, waiters = 0, others = 0;
  for (int32_t p = 0; p < size; p++) {
    causes += missing[p] && !waiting[p];
    waiters += missing[p] && waiting[p];
    others += also[p] != 0;
  }
  out[0] = '\0';
  if (causes) {
    comm_ranks(out, out_size, &used, size, missing, waiting);
    comm_append(out, out_size, &used, " did not arrive within %g s (comm timeout_seconds): no "
                "message of this %s came from %s (failed before it, stuck, or in another call)",
                timeout, op, causes > 1 ? "them" : "it");
  }
  if (waiters) {
    if (used) comm_append(out, out_size, &used, "; ");
    comm_ranks(out, out_size, &used, size, waiting, NULL);
    comm_append(out, out_size, &used, " did not arrive %s but only waiting: blocked in another "
                "call, %s timed out waiting for ", causes ? "either," : "within the timeout,",
                waiters > 1 ? "they" : "it");
    comm_ranks(out, out_size, &used, size, behind, NULL);
  }
  if (others) {
    comm_append(out, out_size, &used, "; ");
    comm_ranks(out, out_size, &used, size, also, NULL);
    comm_append(out, out_size, &used, " timed out waiting for ");
    comm_ranks(out, out_size, &used, size, also_behind, NULL);
    comm_append(out, out_size, &used, " too");
  }
}

/* Turns the caller's comm id into the comm in place, or refuses it. */
static epx_status_t comm_lookup(const char *fn, epx_comm_t *comm) {
  EPX_REQUIRE(*comm, "%s: comm is NULL; pass a comm from epx_comm_create_*", fn);
  epx_comm_t object = epx_registry_get(*comm, EPX_OBJECT_COMM);
  if (!object)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "%s: comm is not a live comm (destroyed already?); pass a comm from "
                     "epx_comm_create_* that has not been destroyed",
                     fn);
  *comm = object;
  return EPX_SUCCESS;
}

epx_status_t epx_comm_create_self(epx_comm_t *comm) {
  epx_error_clear();
  EPX_REQUIRE(comm, "epx_comm_create_self: comm is NULL; pass the address of an epx_comm_t");
  const epx_comm_config_t defaults = EPX_COMM_CONFIG_INIT;
  epx_comm_t created = NULL;
  epx_status_t status = epx_comm_new("epx_comm_create_self", defaults.timeout_seconds, &created);
  if (status != EPX_SUCCESS) return status;
  status = epx_comm_init_self(created);
  if (status == EPX_SUCCESS) status = epx_comm_topology_init(created, "epx_comm_create_self", 0, NULL);
  if (status != EPX_SUCCESS) {
    epx_comm_free(created);
    return status;
  }
  *comm = created->id;
  return EPX_SUCCESS;
}

epx_status_t epx_comm_create_local(epx_local_world_t world, int32_t rank, epx_comm_t *comm) {
  epx_error_clear();
  EPX_REQUIRE(comm, "epx_comm_create_local: comm is NULL; pass the address of an epx_comm_t");
  EPX_REQUIRE(world,
              "epx_comm_create_local: world is NULL; create one with epx_local_world_create");
  world = epx_registry_get(world, EPX_OBJECT_LOCAL_WORLD);
  if (!world)
    return epx_error(EPX_ERROR_INVALID_HANDLE,
                     "epx_comm_create_local: world is not a live local world (destroyed "
                     "already?); pass one from epx_local_world_create");
  epx_comm_t created = NULL;
  /* The world's timeout replaces this one in epx_comm_init_local. */
  epx_status_t status = epx_comm_new("epx_comm_create_local", 0.0, &created);
  if (status != EPX_SUCCESS) return status;
  status = epx_comm_init_local(created, world, rank);
  if (status != EPX_SUCCESS) {
    epx_comm_free(created);
    return status;
  }
  *comm = created->id;
  return EPX_SUCCESS;
}

epx_status_t epx_comm_config_full(const char *caller, const epx_comm_config_t *config, epx_comm_config_t *full) {
  *full = (epx_comm_config_t)EPX_COMM_CONFIG_INIT;
  return config ? epx_config_read(caller, "epx_comm_config_t", config, full, sizeof *full) : EPX_SUCCESS;
}

epx_status_t epx_comm_config_timeout(const char *caller, const epx_comm_config_t *config,
                                     double *timeout_seconds) {
  epx_comm_config_t full;
  epx_status_t status = epx_comm_config_full(caller, config, &full);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(!isnan(full.timeout_seconds),
              "%s: config->timeout_seconds is NaN; pass seconds (> 0) or <= 0 to wait forever",
              caller);
  *timeout_seconds = full.timeout_seconds;
  return EPX_SUCCESS;
}

epx_status_t epx_comm_new_configured(const char *fn, const epx_comm_config_t *config, epx_comm_t *out) {
  double timeout;
  epx_status_t status = epx_comm_config_timeout(fn, config, &timeout);
  return status != EPX_SUCCESS ? status : epx_comm_new(fn, timeout, out);
}

epx_status_t epx_comm_create_mpi(const void *mpi_comm, const epx_comm_config_t *config,
                                 epx_comm_t *comm) {
  epx_error_clear();
  EPX_REQUIRE(comm, "epx_comm_create_mpi: comm is NULL; pass the address of an epx_comm_t");
  EPX_REQUIRE(mpi_comm,
              "epx_comm_create_mpi: mpi_comm is NULL; pass the address of an MPI_Comm "
              "variable (MPI_Comm world = MPI_COMM_WORLD; ... &world)");
  double timeout_seconds;
  int32_t ranks_per_node = 0;
  epx_status_t checked = epx_comm_config_timeout("epx_comm_create_mpi", config, &timeout_seconds);
  if (checked == EPX_SUCCESS) checked = epx_comm_config_ranks_per_node("epx_comm_create_mpi", config, &ranks_per_node);
  if (checked != EPX_SUCCESS) return checked;
#if EPX_HAVE_MPI || EPX_MPI_PLUGIN
  epx_comm_t created = NULL;
  epx_status_t status = epx_comm_new("epx_comm_create_mpi", timeout_seconds, &created);
  if (status != EPX_SUCCESS) return status;
  status = epx_comm_init_mpi(created, mpi_comm);
  if (status != EPX_SUCCESS) {
    epx_comm_free(created);
    return status;
  }
  int64_t host_key = 0;
  if (ranks_per_node == 0) status = epx_comm_mpi_host_key(created, &host_key);
  if (status == EPX_SUCCESS) status = epx_comm_topology_init(created, "epx_comm_create_mpi", ranks_per_node, &host_key);
  if (status != EPX_SUCCESS) {
    created->ops->destroy(created);
    epx_comm_free(created);
    return status;
  }
  *comm = created->id;
  return EPX_SUCCESS;
#else
  return epx_error(EPX_ERROR_UNSUPPORTED,
                   "epx_comm_create_mpi: this build of epx has no MPI transport (MPI was not "
                   "found when it was configured); install MPI and rebuild with "
                   "-DEPX_BUILD_MPI=ON, or use epx_comm_create_shm for processes of one host "
                   "or epx_local_world_create for ranks as threads");
#endif
}

/* A comm that cannot synchronise any more (failed, or its peers are in another
 * collective) is still released: destroy never leaves a comm half-alive, and
 * its peers learn of it from their own calls. */
epx_status_t epx_comm_destroy(epx_comm_t comm) {
  epx_error_clear();
  if (!comm) return EPX_SUCCESS;
  const epx_comm_t id = comm;
  epx_status_t status = comm_lookup("epx_comm_destroy", &comm);
  if (status != EPX_SUCCESS) return status;
  if (comm->live_buffers > 0)
    return epx_error(EPX_ERROR_BUSY,
                     "epx_comm_destroy: %lld buffer(s) created over this comm are alive; "
                     "destroy them with epx_buffer_destroy first",
                     (long long)comm->live_buffers);
  if (!comm->failed) (void)comm->ops->barrier(comm, "epx_comm_destroy");
  if (comm->device_release) comm->device_release(comm);
  epx_registry_remove(id);
  comm->ops->destroy(comm);
  epx_comm_topology_free(comm);
  free(comm->masked);
  free(comm);
  epx_error_clear();
  return EPX_SUCCESS;
}

epx_status_t epx_comm_rank(epx_comm_t comm, int32_t *rank) {
  epx_error_clear();
  epx_status_t status = comm_lookup("epx_comm_rank", &comm);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(rank, "epx_comm_rank: rank is NULL; pass the address of an int32_t");
  *rank = comm->rank;
  return EPX_SUCCESS;
}

epx_status_t epx_comm_size(epx_comm_t comm, int32_t *size) {
  epx_error_clear();
  epx_status_t status = comm_lookup("epx_comm_size", &comm);
  if (status != EPX_SUCCESS) return status;
  EPX_REQUIRE(size, "epx_comm_size: size is NULL; pass the address of an int32_t");
  *size = comm->size;
  return EPX_SUCCESS;
}

epx_status_t epx_comm_alltoallv_count_error(const char *caller, int32_t source, int64_t count, int32_t rank,
                                            int64_t expected) {
  return epx_error(EPX_ERROR_INTERNAL,
                   "%s: rank %d sends %lld units to rank %d, which expects %lld (recv_counts[%d]); the "
                   "count exchange before this alltoallv is inconsistent",
                   caller, source, (long long)count, rank, (long long)expected, source);
}

struct timespec epx_comm_deadline(double seconds) {
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  double whole = floor(seconds);
  deadline.tv_sec += (time_t)whole;
  deadline.tv_nsec += (long)((seconds - whole) * 1e9);
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  return deadline;
}

epx_status_t epx_comm_world_failed_error(const char *caller, int same_barrier, epx_status_t status,
                                         const char *fail_caller, const char *fail_reason) {
  if (!same_barrier)
    return epx_error(EPX_ERROR_PEER_FAILED,
                     "%s: the comm failed earlier, in %s: %s; destroy it and create a new one",
                     caller, fail_caller, fail_reason);
  if (status == EPX_ERROR_TIMEOUT)
    return epx_error(EPX_ERROR_TIMEOUT,
                     "%s: %s; a missing rank failed before this collective or is stuck. The "
                     "comm is now failed (later calls return EPX_ERROR_PEER_FAILED); destroy it",
                     caller, fail_reason);
  return epx_error(status, "%s: %s; the comm is now failed, destroy it", caller, fail_reason);
}

epx_status_t epx_comm_world_missed_failure_error(epx_comm_t comm, const char *caller, uint32_t failures,
                                                 uint32_t *seen, epx_status_t fail_status, const char *fail_caller,
                                                 const char *fail_reason) {
  if (failures == *seen) return EPX_SUCCESS;
  comm->failed = 1;
  *seen = failures;
  return epx_comm_world_failed_error(caller, 1, fail_status, fail_caller, fail_reason);
}

void epx_comm_world_timeout_reason(char *out, size_t out_size, int32_t size,
                                   int (*arrived)(const void *world, int32_t rank), const void *world,
                                   double timeout) {
  char ranks[256];
  size_t used = 0;
  int32_t missing = 0, named = 0;
  ranks[0] = 0;
  for (int32_t p = 0; p < size; p++) {
    if (arrived(world, p)) continue;
    missing++;
    if (named < 16 && used < sizeof ranks) {
      int n = snprintf(ranks + used, sizeof ranks - used, "%s%d", named ? ", " : "", p);
      if (n > 0) used += (size_t)n;
      named++;
    }
  }
  if (missing > named && used < sizeof ranks)
    snprintf(ranks + used, sizeof ranks - used, ", ... (%d in all)", missing);
  snprintf(out, out_size, "rank%s %s did not arrive within %g s (comm timeout_seconds)",
           missing > 1 ? "s" : "", ranks, timeout);
}

uint64_t epx_comm_pid_ns(void) {
  struct stat info;
  return stat("/proc/self/ns/pid", &info) == 0 ? (uint64_t)info.st_ino : 0;
}

char epx_comm_process_state(int32_t pid, uint64_t pid_ns, uint64_t own_pid_ns) {
  if (pid <= 0 || !pid_ns || pid_ns != own_pid_ns) return 0;
  if (kill(pid, 0) != 0 && errno == ESRCH) return 'X';
  char path[48], line[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(line, 1, sizeof line - 1, f);
  fclose(f);
  line[n] = 0;
  const char *end = strrchr(line, ')');
  return end && end[1] == ' ' ? end[2] : 0;
}

int epx_comm_process_gone(int32_t pid, uint64_t pid_ns, uint64_t own_pid_ns) {
  char state = epx_comm_process_state(pid, pid_ns, own_pid_ns);
  return state == 'Z' || state == 'X';
}
