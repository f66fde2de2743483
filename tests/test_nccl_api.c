/* The NCCL comm calls without a GPU: in a build without NCCL each refuses
 * with EPX_ERROR_UNSUPPORTED and a message that says how to get it; in a
 * build with NCCL the argument checks come first (NULLs, rank and size) and
 * refuse without touching NCCL. A CUDA buffer over a local comm of 2 ranks
 * (threads) or an shm comm of 2 ranks (the ipc transport) is made where a
 * one-rank CUDA buffer can be, and refused on every rank with the one-rank
 * buffer's status elsewhere. The
 * NCCL paths themselves run on GPUs (tests/gpu/mpi_gpu_exchange.c,
 * nccl_gpu_kill.c). */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"
#include "buffer_config.h"

static void test_without_or_before_nccl(void **state) {
  (void)state;
  epx_comm_t comm = NULL;
  epx_nccl_unique_id_t id;
  memset(&id, 0, sizeof id);
  if (!epx_has_nccl()) {
    assert_int_equal(epx_nccl_get_unique_id(&id), EPX_ERROR_UNSUPPORTED);
    assert_non_null(strstr(epx_last_error(), "no NCCL transport"));
    assert_int_equal(epx_comm_create_nccl_id(&id, 0, 1, NULL, &comm), EPX_ERROR_UNSUPPORTED);
    assert_int_equal(epx_comm_create_nccl((void *)&id, NULL, &comm), EPX_ERROR_UNSUPPORTED);
    int dummy = 0;
    assert_int_equal(epx_comm_create_nccl_mpi(&dummy, NULL, &comm), EPX_ERROR_UNSUPPORTED);
    assert_null(comm);
    return;
  }
  /* with NCCL: refused before NCCL is reached */
  assert_int_equal(epx_nccl_get_unique_id(NULL), EPX_ERROR_INVALID_ARGUMENT);
  assert_int_equal(epx_comm_create_nccl_id(NULL, 0, 2, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT);
  assert_non_null(strstr(epx_last_error(), "id is NULL"));
  assert_int_equal(epx_comm_create_nccl_id(&id, 2, 2, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT);
  assert_non_null(strstr(epx_last_error(), "rank 2 and size 2"));
  assert_int_equal(epx_comm_create_nccl_id(&id, 0, 2, NULL, NULL), EPX_ERROR_INVALID_ARGUMENT);
  assert_int_equal(epx_comm_create_nccl(NULL, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT);
  assert_non_null(strstr(epx_last_error(), "nccl_comm is NULL"));
  assert_int_equal(epx_comm_create_nccl_mpi(NULL, NULL, &comm), EPX_ERROR_INVALID_ARGUMENT);
  assert_null(comm);
}

typedef struct {
  epx_local_world_t world;
  int32_t rank;
  epx_status_t status;
} rank_arg_t;

static epx_status_t cuda_buffer_over(epx_comm_t comm) {
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_BFLOAT16, 64, 8, 2, 0);
  epx_buffer_t buffer = NULL;
  epx_status_t status = epx_buffer_create(comm, &cfg, &buffer);
  epx_buffer_destroy(buffer);
  return status;
}

static void *cuda_over_local(void *p) {
  rank_arg_t *a = p;
  epx_comm_t comm;
  a->status = epx_comm_create_local(a->world, a->rank, &comm);
  if (a->status != EPX_SUCCESS) return NULL;
  a->status = cuda_buffer_over(comm);
  epx_comm_destroy(comm);
  return NULL;
}

static void test_cuda_buffer_over_local_comm(void **state) {
  (void)state;
  epx_comm_t self;
  assert_int_equal(epx_comm_create_self(&self), EPX_SUCCESS);
  const epx_status_t one_rank = cuda_buffer_over(self); /* no CUDA build, no GPU: refused */
  epx_comm_destroy(self);
  epx_local_world_t world;
  assert_int_equal(epx_local_world_create(2, NULL, &world), EPX_SUCCESS);
  rank_arg_t args[2] = {{world, 0, EPX_SUCCESS}, {world, 1, EPX_SUCCESS}};
  pthread_t threads[2];
  for (int r = 0; r < 2; r++) pthread_create(&threads[r], NULL, cuda_over_local, &args[r]);
  for (int r = 0; r < 2; r++) pthread_join(threads[r], NULL);
  assert_int_equal(epx_local_world_destroy(world), EPX_SUCCESS);
  for (int r = 0; r < 2; r++) assert_int_equal(args[r].status, one_rank);
}

typedef struct {
  const char *name;
  int32_t rank;
  epx_status_t status;
  char message[512];
} shm_arg_t;

static void *cuda_over_shm(void *p) {
  shm_arg_t *a = p;
  epx_comm_config_t config = EPX_COMM_CONFIG_INIT;
  config.timeout_seconds = 20;
  epx_comm_t comm;
  a->status = epx_comm_create_shm(a->name, a->rank, 2, &config, &comm);
  if (a->status != EPX_SUCCESS) return NULL;
  epx_buffer_config_t cfg = tu_config(EPX_DEVICE_CUDA, EPX_BFLOAT16, 64, 8, 2, 0);
  epx_buffer_t buffer = NULL;
  a->status = epx_buffer_create(comm, &cfg, &buffer);
  snprintf(a->message, sizeof a->message, "%s", epx_last_error());
  epx_buffer_destroy(buffer);
  epx_comm_destroy(comm);
  return NULL;
}

/* An shm comm (processes of one host; here two threads, each a rank) takes a
 * CUDA buffer through the ipc transport: refused only as a one-rank buffer
 * is (no CUDA backend, named; or no GPU), never for its comm. */
static void test_cuda_buffer_over_shm_comm(void **state) {
  (void)state;
  epx_comm_t self;
  assert_int_equal(epx_comm_create_self(&self), EPX_SUCCESS);
  const epx_status_t one_rank = cuda_buffer_over(self);
  epx_comm_destroy(self);
  char name[64];
  snprintf(name, sizeof name, "epx-test-nccl-api-%d", (int)getpid());
  shm_arg_t args[2] = {{name, 0, EPX_SUCCESS, ""}, {name, 1, EPX_SUCCESS, ""}};
  pthread_t threads[2];
  for (int r = 0; r < 2; r++) pthread_create(&threads[r], NULL, cuda_over_shm, &args[r]);
  for (int r = 0; r < 2; r++) pthread_join(threads[r], NULL);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(args[r].status, one_rank);
    assert_null(strstr(args[r].message, "needs an NCCL comm"));
    if (!epx_has_cuda()) assert_non_null(strstr(args[r].message, "no CUDA backend"));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_without_or_before_nccl),
      cmocka_unit_test(test_cuda_buffer_over_local_comm),
      cmocka_unit_test(test_cuda_buffer_over_shm_comm),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
