/* epx-bench's command line: the options, their defaults per mode and the
 * checks that refuse a run which cannot work (exit status 2). */
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* ------------------------------------------------------------------------ */
/* Options                                                                   */
/* ------------------------------------------------------------------------ */

const char *dtype_name(epx_dtype_t d) {
  return d == EPX_BFLOAT16 ? "bf16" : d == EPX_FLOAT16 ? "f16" : "f32";
}
const char *exchange_name(int x) { return x == EPX_EXCHANGE_DEDUP ? "dedup" : "collective"; }
const char *fp8_name(epx_fp8_format_t f) {
  return f == EPX_FP8_E4M3_F32_128 ? "e4m3" : f == EPX_FP8_E4M3_UE8M0_128 ? "ue8m0" : f == EPX_FP8_MXFP8 ? "mxfp8"
                                                                                                       : "none";
}
const char *layout_name(epx_layout_t l) {
  return l == EPX_LAYOUT_RANK_MAJOR ? "rank" : l == EPX_LAYOUT_CAPACITY ? "capacity" : "expert";
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: epx-bench [options]\n"
          "  With no options: one MoE layer step (route, dispatch, SwiGLU experts on OpenBLAS,\n"
          "  combine, and the backward of all of it) on 4 in-process ranks, both exchanges,\n"
          "  timed per phase and checked against a dense reference. The last line is OK or\n"
          "  FAILED and the exit status matches it.\n"
          "\n"
          "  --tokens T            tokens per rank (2048; --single: 8192)\n"
          "  --hidden H            hidden size, a multiple of 8 (1024; --single: 2048)\n"
          "  --experts E           experts, a multiple of the ranks (64; --single: 16)\n"
          "  --topk K              experts per token (6; --single: 3)\n"
          "  --ffn F               SwiGLU intermediate size (128); 0: a per-expert scale\n"
          "                        instead of the FFN (exchange-bound runs)\n"
          "  --ranks W             in-process ranks of the local transport (4)\n"
          "  --dtype f32|bf16|f16  payload dtype (f32; --single: f32 then bf16)\n"
          "  --exchange dedup|collective|both   (both)\n"
          "  --layout expert|rank|capacity      receive layout (expert)\n"
          "  --transport local|mpi (local; mpi when started by mpirun)\n"
          "  --device cpu|cuda     the buffers' device (cpu); cuda: under mpirun, one process\n"
          "                        per GPU over NCCL, routing on the GPU, experts on the host\n"
          "  --iters N             timed iterations, the median is reported (3; --single: 10)\n"
          "  --warmup N            untimed iterations first (1; --single: 2)\n"
          "  --zipf S              routing skew: expert popularity follows Zipf(S) (0: uniform)\n"
          "  --capacity-factor C   capacity mode with factor C (0: dropless; --single and\n"
          "                        --layout capacity: 1.0)\n"
          "  --seed N              seed of every random input (1)\n"
          "  --record-trace FILE   write every rank's routing as an epx-replay trace\n"
          "                        (one layer, one step; tools/epx-replay.c's format)\n"
          "  --single              one-rank microbenchmark of route/dispatch/combine forward\n"
          "                        and backward against memcpy and the dense one-hot reference\n"
          "  --fp8 e4m3|ue8m0|mxfp8  with --single: also epx_dispatch_fp8 (rows quantized by\n"
          "                        epx_quantize first) and epx_dispatch_quantize in that format\n"
          "                        (e4m3 with float32 scales per 128, the same as UE8M0, or\n"
          "                        MXFP8), beside the dtype's dispatch; f32 and bf16 only\n"
          "  --no-check            skip the correctness checks\n"
          "  --csv                 print the timing table as CSV\n"
          "  --help                this text\n");
}

static int parse_dtype(const char *s) {
  if (!strcmp(s, "f32") || !strcmp(s, "float32")) return EPX_FLOAT32;
  if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) return EPX_BFLOAT16;
  if (!strcmp(s, "f16") || !strcmp(s, "float16")) return EPX_FLOAT16;
  return -1;
}

static int64_t parse_int(const char *opt, const char *s, int64_t lo) {
  char *end;
  long long v = strtoll(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < lo) {
    fprintf(stderr, "epx-bench: %s %s: expected an integer >= %lld\n", opt, s, (long long)lo);
    exit(2);
  }
  return (int64_t)v;
}

static double parse_real(const char *opt, const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*s == '\0' || *end != '\0' || !(v >= 0.0)) {
    fprintf(stderr, "epx-bench: %s %s: expected a number >= 0\n", opt, s);
    exit(2);
  }
  return v;
}

const char *env_nonempty(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

/* One option and its value (NULL for a flag); 0 if the name is unknown. */
static int parse_option(const char *name, const char *val, options_t *o) {
  if (!strcmp(name, "--help") || !strcmp(name, "-h")) {
    usage(stdout);
    exit(0);
  } else if (!strcmp(name, "--single")) {
    o->single = 1;
  } else if (!strcmp(name, "--no-check")) {
    o->check = 0;
  } else if (!strcmp(name, "--csv")) {
    o->csv = 1;
  } else if (!strcmp(name, "--tokens")) {
    o->tokens = parse_int(name, val, 0);
  } else if (!strcmp(name, "--hidden")) {
    o->hidden = parse_int(name, val, 8);
  } else if (!strcmp(name, "--experts")) {
    o->experts = (int32_t)parse_int(name, val, 1);
  } else if (!strcmp(name, "--topk")) {
    o->topk = (int32_t)parse_int(name, val, 1);
  } else if (!strcmp(name, "--ffn")) {
    o->ffn = (int32_t)parse_int(name, val, 0);
  } else if (!strcmp(name, "--ranks")) {
    o->ranks = (int32_t)parse_int(name, val, 1);
  } else if (!strcmp(name, "--iters")) {
    o->iters = (int)parse_int(name, val, 1);
  } else if (!strcmp(name, "--warmup")) {
    o->warmup = (int)parse_int(name, val, 0);
  } else if (!strcmp(name, "--record-trace")) {
    o->record_trace = val;
  } else if (!strcmp(name, "--seed")) {
    o->seed = (uint64_t)parse_int(name, val, 0);
  } else if (!strcmp(name, "--zipf")) {
    o->zipf = parse_real(name, val);
  } else if (!strcmp(name, "--capacity-factor")) {
    o->capacity_factor = parse_real(name, val);
  } else if (!strcmp(name, "--dtype")) {
    o->dtype = parse_dtype(val);
    if (o->dtype < 0) {
      fprintf(stderr, "epx-bench: --dtype %s: expected f32, bf16 or f16\n", val);
      exit(2);
    }
  } else if (!strcmp(name, "--exchange")) {
    if (!strcmp(val, "dedup")) o->exchange = CHOOSE_DEDUP;
    else if (!strcmp(val, "collective")) o->exchange = CHOOSE_COLLECTIVE;
    else if (!strcmp(val, "both")) o->exchange = CHOOSE_BOTH;
    else {
      fprintf(stderr, "epx-bench: --exchange %s: expected dedup, collective or both\n", val);
      exit(2);
    }
  } else if (!strcmp(name, "--layout")) {
    if (!strcmp(val, "expert")) o->layout = EPX_LAYOUT_EXPERT_MAJOR;
    else if (!strcmp(val, "rank")) o->layout = EPX_LAYOUT_RANK_MAJOR;
    else if (!strcmp(val, "capacity")) o->layout = EPX_LAYOUT_CAPACITY;
    else {
      fprintf(stderr, "epx-bench: --layout %s: expected expert, rank or capacity\n", val);
      exit(2);
    }
  } else if (!strcmp(name, "--fp8")) {
    if (!strcmp(val, "e4m3")) o->fp8 = EPX_FP8_E4M3_F32_128;
    else if (!strcmp(val, "ue8m0")) o->fp8 = EPX_FP8_E4M3_UE8M0_128;
    else if (!strcmp(val, "mxfp8")) o->fp8 = EPX_FP8_MXFP8;
    else if (!strcmp(val, "none")) o->fp8 = EPX_FP8_NONE;
    else {
      fprintf(stderr, "epx-bench: --fp8 %s: expected e4m3, ue8m0, mxfp8 or none\n", val);
      exit(2);
    }
  } else if (!strcmp(name, "--device")) {
    if (!strcmp(val, "cuda")) o->cuda = 1;
    else if (!strcmp(val, "cpu")) o->cuda = 0;
    else {
      fprintf(stderr, "epx-bench: --device %s: expected cpu or cuda\n", val);
      exit(2);
    }
  } else if (!strcmp(name, "--transport")) {
    if (!strcmp(val, "mpi")) o->mpi = 1;
    else if (!strcmp(val, "local")) o->mpi = 0;
    else {
      fprintf(stderr, "epx-bench: --transport %s: expected local or mpi\n", val);
      exit(2);
    }
  } else {
    return 0;
  }
  return 1;
}

/* The mode's defaults for what was not given. */
static void apply_defaults(options_t *o) {
  if (o->single) {
    if (o->tokens < 0) o->tokens = 8192;
    if (o->hidden < 0) o->hidden = 2048;
    if (o->experts < 0) o->experts = 16;
    if (o->topk < 0) o->topk = 3;
    if (o->iters < 0) o->iters = 10;
    if (o->warmup < 0) o->warmup = 2;
    if (o->capacity_factor < 0) o->capacity_factor = 1.0;
    o->ranks = 1;
  } else {
    if (o->tokens < 0) o->tokens = 2048;
    if (o->hidden < 0) o->hidden = 1024;
    if (o->experts < 0) o->experts = 64;
    if (o->topk < 0) o->topk = 6;
    if (o->iters < 0) o->iters = 3;
    if (o->warmup < 0) o->warmup = 1;
    if (o->ranks < 0) o->ranks = 4;
    if (o->capacity_factor < 0) o->capacity_factor = o->layout == EPX_LAYOUT_CAPACITY ? 1.0 : 0.0;
    if (o->layout == EPX_LAYOUT_CAPACITY && o->capacity_factor == 0.0) {
      fprintf(stderr, "epx-bench: --layout capacity needs --capacity-factor > 0\n");
      exit(2);
    }
  }
  if (o->ffn < 0) o->ffn = 128;
}

/* Runs that cannot work: say why and exit 2. */
static void refuse_impossible(const options_t *o) {
  if (o->hidden % 8) {
    fprintf(stderr, "epx-bench: --hidden %lld: must be a multiple of 8\n", (long long)o->hidden);
    exit(2);
  }
  if (o->topk > o->experts) {
    fprintf(stderr, "epx-bench: --topk %d > --experts %d\n", (int)o->topk, (int)o->experts);
    exit(2);
  }
  if (o->layout == EPX_LAYOUT_RANK_MAJOR && o->topk > o->hidden) {
    fprintf(stderr, "epx-bench: --layout rank returns grad_w through a combine of [N, H] rows: needs --topk <= --hidden\n");
    exit(2);
  }
  if (o->cuda && (o->single || !o->mpi)) {
    fprintf(stderr, "epx-bench: --device cuda runs the main job under mpirun (one process per GPU)\n");
    exit(2);
  }
  if (o->fp8 != EPX_FP8_NONE) {
    int64_t cols;
    size_t entry;
    if (!o->single) {
      fprintf(stderr, "epx-bench: --fp8 times the fp8 dispatches of --single; add --single\n");
      exit(2);
    }
    if (epx_fp8_scale_shape(o->fp8, o->hidden, &cols, &entry) != EPX_SUCCESS) {
      fprintf(stderr, "epx-bench: --fp8 %s with --hidden %lld: %s\n", fp8_name(o->fp8), (long long)o->hidden,
              epx_last_error());
      exit(2);
    }
    if (o->dtype == EPX_FLOAT16) {
      fprintf(stderr, "epx-bench: --fp8: an fp8 buffer combines in bf16 or f32; use --dtype bf16 or f32\n");
      exit(2);
    }
  }
  if (o->single && o->layout == EPX_LAYOUT_RANK_MAJOR) {
    fprintf(stderr, "epx-bench: --single compares with the dense [E, C, H] reference: use --layout expert or capacity\n");
    exit(2);
  }
}

void parse_options(int argc, char **argv, options_t *o) {
  *o = (options_t){-1, -1, -1, -1, -1, -1, -1, CHOOSE_BOTH, EPX_LAYOUT_EXPERT_MAJOR, 0,
                   -1, -1, 0.0, -1.0, 0, 1, 0, 1, 0, NULL, EPX_FP8_NONE};
  o->mpi = env_nonempty("OMPI_COMM_WORLD_SIZE") || env_nonempty("PMI_SIZE") ||
           env_nonempty("PMIX_RANK");
  for (int i = 1; i < argc; i++) {
    char *arg = argv[i];
    const char *val = NULL;
    char name[64];
    char *eq = strchr(arg, '=');
    if (eq && (size_t)(eq - arg) < sizeof name) {
      memcpy(name, arg, (size_t)(eq - arg));
      name[eq - arg] = '\0';
      val = eq + 1;
    } else {
      snprintf(name, sizeof name, "%s", arg);
    }
    int flag = !strcmp(name, "--single") || !strcmp(name, "--no-check") || !strcmp(name, "--csv") ||
               !strcmp(name, "--help") || !strcmp(name, "-h");
    if (!flag && !val) {
      if (i + 1 >= argc) {
        fprintf(stderr, "epx-bench: %s needs a value (see --help)\n", name);
        exit(2);
      }
      val = argv[++i];
    }
    if (!parse_option(name, val, o)) {
      fprintf(stderr, "epx-bench: unknown option %s (see --help)\n", arg);
      exit(2);
    }
  }
  apply_defaults(o);
  refuse_impossible(o);
}
