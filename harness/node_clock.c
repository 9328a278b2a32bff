/* A simulated node's wall clock, NODE_CLOCK_OFFSET seconds off the machine's (demo/cluster.py).
 *
 * Preloaded (LD_PRELOAD) into a node's sidecar, torchrun agent and ranks: every read of the
 * realtime clock through libc (clock_gettime's CLOCK_REALTIME*, gettimeofday, time: Python's
 * time.time(), C++'s system_clock, the Flight Recorder's timestamps) is moved by the offset;
 * the monotonic clocks, sleeps and timed waits are the kernel's own. Debian's libfaketime does
 * more and breaks Python here: time.sleep fails with EINVAL when its monotonic clock is left
 * alone, and every timed lock wait hangs when it is not (0.9.10). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long offset_ns;
static int (*real_clock_gettime)(clockid_t, struct timespec *);

__attribute__((constructor)) static void node_clock_init(void) {
    const char *s = getenv("NODE_CLOCK_OFFSET");
    offset_ns = s ? (long long)(strtod(s, NULL) * 1e9) : 0;
    real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    if (!real_clock_gettime) node_clock_init();
    int r = real_clock_gettime(clock, ts);
    if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    (void)tz;
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    if (r == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
