/* An LD_PRELOAD library for the tests: fdatasync() and fsync() of a file
 * whose path ends with $FAILSYNC_SUFFIX do their work, then report EIO, as
 * many times as the number in the file $FAILSYNC_CONTROL says (decremented
 * at each failure; 0 or no file: none). A commit of the shadow's embedded
 * state (SQLite, WAL, synchronous=FULL) then fails after its frames were
 * written: an outcome that is unknown, which a restart may find applied. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

static int (*real_fdatasync)(int);
static int (*real_fsync)(int);

static int take_one(int fd) {
    const char *ctl = getenv("FAILSYNC_CONTROL");
    const char *suffix = getenv("FAILSYNC_SUFFIX");
    if (!ctl || !suffix || !*suffix) return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    size_t ls = strlen(suffix);
    if ((size_t)n < ls || strcmp(path + n - ls, suffix) != 0) return 0;
    int cfd = open(ctl, O_RDWR | O_CLOEXEC);
    if (cfd < 0) return 0;
    int hit = 0;
    if (flock(cfd, LOCK_EX) == 0) {
        char buf[32] = {0};
        if (pread(cfd, buf, sizeof buf - 1, 0) > 0) {
            long left = strtol(buf, NULL, 10);
            if (left > 0) {
                int len = snprintf(buf, sizeof buf, "%ld\n", left - 1);
                if (ftruncate(cfd, 0) == 0 && pwrite(cfd, buf, len, 0) == len) hit = 1;
            }
        }
    }
    close(cfd);
    return hit;
}

int fdatasync(int fd) {
    if (!real_fdatasync) real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int rc = real_fdatasync(fd);
    if (rc == 0 && take_one(fd)) { errno = EIO; return -1; }
    return rc;
}

int fsync(int fd) {
    if (!real_fsync) real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int rc = real_fsync(fd);
    if (rc == 0 && take_one(fd)) { errno = EIO; return -1; }
    return rc;
}
