/* A stand-in for libcuda.so.1's checkpoint API, for testing the ctypes plumbing
 * of nodeagent.backends.cuda_driver on machines without a GPU.
 *
 * Same symbol names, signatures and argument structs as the driver. A pid has
 * CUDA only after fakeAddProcess(pid); the state machine and the result codes
 * follow the driver: NOT_INITIALIZED (3) for a process without CUDA, ILLEGAL_STATE
 * (401) for a wrong transition, NOT_READY (600) for a lock that times out (here:
 * any lock on a pid marked busy), OUT_OF_MEMORY (2) for a restore while the
 * device is marked full. Reserved fields must be zero, else INVALID_VALUE (1).
 */
#include <stdint.h>
#include <string.h>

typedef struct { unsigned int timeoutMs, reserved0; uint64_t reserved1[7]; } LockArgs;
typedef struct { uint64_t reserved[8]; } Args64;

enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2 };
#define MAXP 64
static int pids[MAXP], states[MAXP], busy[MAXP], nprocs, device_full;
static unsigned int last_timeout;

static int find(int pid) { for (int i = 0; i < nprocs; i++) if (pids[i] == pid) return i; return -1; }
static int zero(const void *p, size_t n) { const unsigned char *c = p; for (size_t i = 0; i < n; i++) if (c[i]) return 0; return 1; }

void fakeAddProcess(int pid) { if (find(pid) < 0 && nprocs < MAXP) { pids[nprocs] = pid; states[nprocs++] = RUNNING; } }
void fakeSetBusy(int pid, int b) { int i = find(pid); if (i >= 0) busy[i] = b; }
void fakeSetDeviceFull(int full) { device_full = full; }
unsigned int fakeLastTimeout(void) { return last_timeout; }

int cuInit(unsigned int flags) { return flags ? 1 : 0; }
int cuDriverGetVersion(int *v) { *v = 12080; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuGetErrorString(int rc, const char **s) {
    switch (rc) {
    case 2: *s = "out of memory"; return 0;
    case 3: *s = "initialization error"; return 0;
    case 401: *s = "the operation cannot be performed in the present state"; return 0;
    case 600: *s = "device not ready"; return 0;
    default: *s = "unknown error"; return 0;
    }
}

int cuCheckpointProcessGetState(int pid, int *state) {
    int i = find(pid); if (i < 0) return 3;
    *state = states[i]; return 0;
}
int cuCheckpointProcessLock(int pid, LockArgs *a) {
    int i = find(pid); if (i < 0) return 3;
    if (a && (a->reserved0 || !zero(a->reserved1, sizeof a->reserved1))) return 1;
    last_timeout = a ? a->timeoutMs : 0;
    if (states[i] != RUNNING) return 401;
    if (busy[i]) return 600;
    states[i] = LOCKED; return 0;
}
int cuCheckpointProcessCheckpoint(int pid, Args64 *a) {
    int i = find(pid); if (i < 0) return 3;
    if (a && !zero(a, sizeof *a)) return 1;
    if (states[i] != LOCKED) return 401;
    states[i] = CHECKPOINTED; return 0;
}
int cuCheckpointProcessRestore(int pid, Args64 *a) {
    int i = find(pid); if (i < 0) return 3;
    if (a && !zero(a, sizeof *a)) return 1;
    if (states[i] != CHECKPOINTED) return 401;
    if (device_full) return 2;
    states[i] = LOCKED; return 0;
}
int cuCheckpointProcessUnlock(int pid, Args64 *a) {
    int i = find(pid); if (i < 0) return 3;
    if (a && !zero(a, sizeof *a)) return 1;
    if (states[i] != LOCKED) return 401;
    states[i] = RUNNING; return 0;
}
