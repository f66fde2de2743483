/* The MPI transport as a plugin (a build with EPX_MPI_PLUGIN, such as the
 * wheel): src/comm/mpi.c is built into libepx_mpi.so beside libepx, its two
 * entry points renamed (epx_mpi_plugin_init, epx_mpi_plugin_host_key), and
 * libepx loads it on the first MPI call. libepx itself then needs no libmpi:
 * it loads on a machine without MPI, where epx_has_mpi() is 0 and
 * epx_comm_create_mpi says why the plugin did not load. Elsewhere this file
 * is empty and mpi.c is part of libepx. */
#if EPX_MPI_PLUGIN
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "comm/comm.h"
#include "core/error.h"

typedef epx_status_t (*mpi_init_fn)(epx_comm_t comm, const void *mpi_comm);
typedef epx_status_t (*mpi_host_key_fn)(epx_comm_t comm, int64_t *key);

static pthread_once_t plugin_once = PTHREAD_ONCE_INIT;
static mpi_init_fn plugin_init;
static mpi_host_key_fn plugin_host_key;
static char plugin_path[4096];
static char plugin_error[512];

/* libepx_mpi.so from libepx's own directory; global, because Open MPI's own
 * components resolve libmpi's symbols in the global scope. */
static void plugin_load(void) {
  Dl_info self;
  if (!dladdr((void *)&epx_has_mpi, &self) || !self.dli_fname) {
    snprintf(plugin_error, sizeof plugin_error, "dladdr cannot name libepx's own file");
    return;
  }
  const char *slash = strrchr(self.dli_fname, '/');
  int dir = slash ? (int)(slash - self.dli_fname) : 1;
  snprintf(plugin_path, sizeof plugin_path, "%.*s/libepx_mpi.so", dir,
           slash ? self.dli_fname : ".");
  void *plugin = dlopen(plugin_path, RTLD_NOW | RTLD_GLOBAL);
  if (!plugin) {
    snprintf(plugin_error, sizeof plugin_error, "%s", dlerror());
    return;
  }
  plugin_init = (mpi_init_fn)dlsym(plugin, "epx_mpi_plugin_init");
  plugin_host_key = (mpi_host_key_fn)dlsym(plugin, "epx_mpi_plugin_host_key");
  if (!plugin_init || !plugin_host_key)
    snprintf(plugin_error, sizeof plugin_error,
             "it lacks epx_mpi_plugin_init (a plugin of another epx version?)");
}

static int plugin_ready(void) {
  pthread_once(&plugin_once, plugin_load);
  return plugin_init && plugin_host_key;
}

int epx_has_mpi(void) { return plugin_ready(); }

epx_status_t epx_comm_init_mpi(epx_comm_t comm, const void *mpi_comm) {
  if (!plugin_ready())
    return epx_error(EPX_ERROR_UNSUPPORTED,
                     "epx_comm_create_mpi: this libepx's MPI transport is a plugin (%s) that did "
                     "not load: %s; install the MPI it was built with (Open MPI's "
                     "libmpi.so.40, say), or use epx_comm_create_shm for processes of one host",
                     plugin_path[0] ? plugin_path : "libepx_mpi.so", plugin_error);
  return plugin_init(comm, mpi_comm);
}

epx_status_t epx_comm_mpi_host_key(epx_comm_t comm, int64_t *key) {
  return plugin_ready() ? plugin_host_key(comm, key)
                        : epx_error(EPX_ERROR_UNSUPPORTED, "epx_comm_create_mpi: %s", plugin_error);
}
#else
typedef int epx_mpi_plugin_unused; /* ISO C forbids an empty translation unit */
#endif
