/* bbio's native hot paths: CRC32C, copy with CRC in one pass, batched preads.
 * See bbio_native_api.h for the contract of each function. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "bbio_native_api.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BBIO_X86_CRC 1
#include <nmmintrin.h>
#endif

#define CRC32C_POLY 0x82f63b78u
#define DEFAULT_BUFFER_SIZE ((size_t)2 << 20)
#define ALIGNMENT 4096u

/* ------------------------------------------------------------------ CRC32C */

static uint32_t crc32c_table[8][256];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

/* CRCs are polynomials over GF(2), reflected (bit 31 is x^0): appending n zero
 * bytes to a message multiplies its CRC by x^(8n) modulo the CRC polynomial. */
static uint32_t multiply_mod_poly(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) {
            product ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return product;
}

#define X_POWERS 67 /* x^(2^k) for k up to 65: n * 2^3 with n below 2^63 */
static uint32_t x_to_2_to_the[X_POWERS];

/* x^(n * 2^k) modulo the CRC polynomial, for k + bits(n) <= X_POWERS. */
static uint32_t x_power(uint64_t n, unsigned k)
{
    uint32_t power = 1u << 31; /* x^0 */
    for (; n; n >>= 1, k++)
        if (n & 1)
            power = multiply_mod_poly(x_to_2_to_the[k], power);
    return power;
}

static void init_tables(void);

uint32_t bbio_crc32c_combine(uint32_t crc1, uint32_t crc2, int64_t len2)
{
    if (len2 <= 0)
        return crc1;
    pthread_once(&tables_once, init_tables);
    return multiply_mod_poly(x_power((uint64_t)len2, 3), crc1) ^ crc2;
}

#ifdef BBIO_X86_CRC
/* The hardware path runs three interleaved streams over blocks of LONG (then
 * SHORT) bytes and merges them by "shifting" a CRC over zero bytes with
 * precomputed operator tables (the method of Mark Adler's crc32c.c). */
#define LONG_BLOCK 8192u
#define SHORT_BLOCK 256u
static uint32_t shift_long[4][256];
static uint32_t shift_short[4][256];

/* A 32x32 bit matrix (32 columns) maps a CRC to the CRC after appending zero
 * bits: the shift tables of the hardware path are built from them. */
static uint32_t gf2_matrix_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1)
            sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_matrix_square(uint32_t *square, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++)
        square[n] = gf2_matrix_times(mat, mat[n]);
}

/* The operator for one zero bit, as a matrix. */
static void one_zero_bit(uint32_t *op)
{
    uint32_t row = 1;
    op[0] = CRC32C_POLY;
    for (int n = 1; n < 32; n++) {
        op[n] = row;
        row <<= 1;
    }
}

/* Operator that appends len zero bytes to a CRC; len must be a power of 2. */
static void zeros_operator(uint32_t *even, size_t len)
{
    uint32_t odd[32];
    one_zero_bit(odd);
    gf2_matrix_square(even, odd); /* two zero bits */
    gf2_matrix_square(odd, even); /* four zero bits */
    do {
        gf2_matrix_square(even, odd);
        len >>= 1;
        if (len == 0)
            return;
        gf2_matrix_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_tables(uint32_t zeros[4][256], size_t len)
{
    uint32_t op[32];
    zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_matrix_times(op, n);
        zeros[1][n] = gf2_matrix_times(op, n << 8);
        zeros[2][n] = gf2_matrix_times(op, n << 16);
        zeros[3][n] = gf2_matrix_times(op, n << 24);
    }
}

static uint32_t crc_shift(uint32_t zeros[4][256], uint32_t crc)
{
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^
           zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}
#endif

static void init_tables(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = n;
        for (int k = 0; k < 8; k++)
            crc = (crc & 1) ? (crc >> 1) ^ CRC32C_POLY : crc >> 1;
        crc32c_table[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = crc32c_table[0][n];
        for (int k = 1; k < 8; k++) {
            crc = crc32c_table[0][crc & 0xff] ^ (crc >> 8);
            crc32c_table[k][n] = crc;
        }
    }
    uint32_t power = 1u << 30; /* x^1 */
    for (int k = 0; k < X_POWERS; k++) {
        x_to_2_to_the[k] = power;
        power = multiply_mod_poly(power, power);
    }
#ifdef BBIO_X86_CRC
    zeros_tables(shift_long, LONG_BLOCK);
    zeros_tables(shift_short, SHORT_BLOCK);
#endif
}

uint32_t bbio_crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *next = buf;
    pthread_once(&tables_once, init_tables);
    crc = ~crc;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (len && ((uintptr_t)next & 7) != 0) {
        crc = crc32c_table[0][(crc ^ *next++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t word;
        memcpy(&word, next, 8);
        word ^= crc;
        crc = crc32c_table[7][word & 0xff] ^
              crc32c_table[6][(word >> 8) & 0xff] ^
              crc32c_table[5][(word >> 16) & 0xff] ^
              crc32c_table[4][(word >> 24) & 0xff] ^
              crc32c_table[3][(word >> 32) & 0xff] ^
              crc32c_table[2][(word >> 40) & 0xff] ^
              crc32c_table[1][(word >> 48) & 0xff] ^
              crc32c_table[0][word >> 56];
        next += 8;
        len -= 8;
    }
#endif
    while (len) {
        crc = crc32c_table[0][(crc ^ *next++) & 0xff] ^ (crc >> 8);
        len--;
    }
    return ~crc;
}

#ifdef BBIO_X86_CRC
__attribute__((target("sse4.2"))) static uint32_t
crc32c_sse42(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *next = buf;
    uint64_t crc0 = ~crc, crc1, crc2;

    while (len && ((uintptr_t)next & 7) != 0) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    while (len >= 3 * LONG_BLOCK) {
        const unsigned char *end = next + LONG_BLOCK;
        crc1 = crc2 = 0;
        do {
            uint64_t w0, w1, w2;
            memcpy(&w0, next, 8);
            memcpy(&w1, next + LONG_BLOCK, 8);
            memcpy(&w2, next + 2 * LONG_BLOCK, 8);
            crc0 = _mm_crc32_u64(crc0, w0);
            crc1 = _mm_crc32_u64(crc1, w1);
            crc2 = _mm_crc32_u64(crc2, w2);
            next += 8;
        } while (next < end);
        crc0 = crc_shift(shift_long, (uint32_t)crc0) ^ crc1;
        crc0 = crc_shift(shift_long, (uint32_t)crc0) ^ crc2;
        next += 2 * LONG_BLOCK;
        len -= 3 * LONG_BLOCK;
    }
    while (len >= 3 * SHORT_BLOCK) {
        const unsigned char *end = next + SHORT_BLOCK;
        crc1 = crc2 = 0;
        do {
            uint64_t w0, w1, w2;
            memcpy(&w0, next, 8);
            memcpy(&w1, next + SHORT_BLOCK, 8);
            memcpy(&w2, next + 2 * SHORT_BLOCK, 8);
            crc0 = _mm_crc32_u64(crc0, w0);
            crc1 = _mm_crc32_u64(crc1, w1);
            crc2 = _mm_crc32_u64(crc2, w2);
            next += 8;
        } while (next < end);
        crc0 = crc_shift(shift_short, (uint32_t)crc0) ^ crc1;
        crc0 = crc_shift(shift_short, (uint32_t)crc0) ^ crc2;
        next += 2 * SHORT_BLOCK;
        len -= 3 * SHORT_BLOCK;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, next, 8);
        crc0 = _mm_crc32_u64(crc0, w);
        next += 8;
        len -= 8;
    }
    while (len) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    return ~(uint32_t)crc0;
}
#endif

int bbio_crc32c_hw_available(void)
{
#ifdef BBIO_X86_CRC
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    return 0;
#endif
}

uint32_t bbio_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
#ifdef BBIO_X86_CRC
    if (bbio_crc32c_hw_available()) {
        pthread_once(&tables_once, init_tables);
        return crc32c_sse42(crc, buf, len);
    }
#endif
    return bbio_crc32c_sw(crc, buf, len);
}

uint32_t bbio_crc32c(uint32_t crc, const void *buf, size_t len)
{
    return bbio_crc32c_hw(crc, buf, len);
}

/* -------------------------------------------------------------------- copy */

/* pread/pwrite that retry on EINTR and, when an O_DIRECT descriptor rejects an
 * unaligned tail (EINVAL), drop O_DIRECT for the rest of the transfer and retry once.
 * drop_direct says 1 once O_DIRECT is off, whether this thread or another (a copy
 * split between threads) turned it off. */
static int drop_direct(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return 0;
    return !(fl & O_DIRECT) || fcntl(fd, F_SETFL, fl & ~O_DIRECT) == 0;
}

static ssize_t pread_retry(int fd, void *buf, size_t len, int64_t off)
{
    int dropped = 0;
    for (;;) {
        ssize_t n = pread(fd, buf, len, (off_t)off);
        if (n >= 0)
            return n;
        if (errno == EINTR)
            continue;
        if (errno == EINVAL && !dropped && drop_direct(fd)) {
            dropped = 1;
            continue;
        }
        return -1;
    }
}

static int pwrite_all(int fd, const unsigned char *buf, size_t len, int64_t off)
{
    int dropped = 0;
    while (len) {
        ssize_t n = pwrite(fd, buf, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EINVAL && !dropped && drop_direct(fd)) {
                dropped = 1;
                continue;
            }
            return errno;
        }
        if (n == 0)
            return EIO;
        buf += n;
        len -= (size_t)n;
        off += n;
    }
    return 0;
}

static int copy_kernel(int src_fd, int dst_fd, int64_t src_off,
                       int64_t dst_off, int64_t len, int64_t *copied,
                       int *failed_fd, int *unsupported)
{
    loff_t in = src_off, out = dst_off;
    int dropped = 0;
    while (len < 0 || *copied < len) {
        size_t want = (len < 0 || len - *copied > (int64_t)(1 << 30))
                          ? (size_t)1 << 30
                          : (size_t)(len - *copied);
        ssize_t n = copy_file_range(src_fd, &in, dst_fd, &out, want, 0);
        if (n > 0) {
            *copied += n;
            continue;
        }
        if (n == 0)
            return 0;
        if (errno == EINTR)
            continue;
        if (errno == EINVAL && *copied > 0 && !dropped) { /* an O_DIRECT tail */
            dropped = 1;
            drop_direct(src_fd);
            drop_direct(dst_fd);
            continue;
        }
        if (*copied == 0 && (errno == EXDEV || errno == ENOSYS ||
                             errno == EOPNOTSUPP || errno == EINVAL ||
                             errno == EBADF || errno == EPERM)) {
            *unsupported = 1;
            return 0;
        }
        int err = errno;
        unsigned char probe; /* which side failed: the source, if it cannot be read */
        if (err == ENOSPC || err == EDQUOT || err == EFBIG)
            *failed_fd = dst_fd;
        else {
            drop_direct(src_fd); /* a 1-byte probe is EINVAL under O_DIRECT */
            *failed_fd = pread(src_fd, &probe, 1, in) < 0 ? src_fd : dst_fd;
        }
        return err;
    }
    return 0;
}

static int copy_buffered(int src_fd, int dst_fd, int64_t src_off,
                         int64_t dst_off, int64_t len, unsigned char *buf,
                         size_t buf_size, int with_crc, int64_t *copied,
                         uint32_t *crc, int *failed_fd)
{
    while (len < 0 || *copied < len) {
        size_t want = buf_size;
        if (len >= 0 && (int64_t)want > len - *copied)
            want = (size_t)(len - *copied);
        ssize_t n = pread_retry(src_fd, buf, want, src_off + *copied);
        if (n < 0) {
            *failed_fd = src_fd;
            return errno;
        }
        if (n == 0)
            return 0;
        if (with_crc)
            *crc = bbio_crc32c(*crc, buf, (size_t)n);
        int err = pwrite_all(dst_fd, buf, (size_t)n, dst_off + *copied);
        if (err) {
            *failed_fd = dst_fd;
            return err;
        }
        *copied += n;
    }
    return 0;
}

/* Large copies run on two threads when the process may use two CPUs: each
 * copies one contiguous half (pread, CRC32C, pwrite through its own part of the
 * buffer, so the bytes never move between CPU caches), and the two CRCs are
 * combined.  Small copies, ranks bound to one core, and BBIO_COPY_SEQUENTIAL
 * copy serially: a network or FUSE file system serializes the writes to one
 * file anyway, and flushes a file written in order faster than one written at
 * two places at once. */
#define SPLIT_THREADS 2
#define SPLIT_MIN_BYTES ((int64_t)8 << 20)
/* Serial copies move at most this much per pread/pwrite, so the buffer stays in
 * the CPU's L2 cache between the read, the CRC and the write. */
#define SERIAL_CHUNK ((size_t)256 << 10)

struct part {
    int src_fd, dst_fd;
    int64_t src_off, dst_off, len;
    unsigned char *buf;
    size_t buf_size;
    int with_crc;
    int64_t copied;
    uint32_t crc;
    int failed_fd;
    int err;
};

/* Create a thread that receives no signal (it is created with every signal
 * blocked, and keeps that mask): signals go to the interpreter's threads, and this
 * thread's file calls are never interrupted (EINTR) by one meant for the job, such
 * as the SIGUSR1 or SIGTERM Slurm sends before a time limit. */
static int create_quiet_thread(pthread_t *thread, const pthread_attr_t *attr,
                               void *(*fn)(void *), void *arg)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = pthread_create(thread, attr, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return err;
}

static void *copy_part(void *arg)
{
    struct part *p = arg;
    p->err = copy_buffered(p->src_fd, p->dst_fd, p->src_off, p->dst_off,
                           p->len, p->buf, p->buf_size, p->with_crc,
                           &p->copied, &p->crc, &p->failed_fd);
    return NULL;
}

/* Returns -1 if the second thread could not start (the caller copies serially). */
static int copy_split(int src_fd, int dst_fd, int64_t src_off, int64_t dst_off,
                      int64_t total, unsigned char *buf, size_t buf_size,
                      int with_crc, int64_t *copied, uint32_t *crc,
                      int *failed_fd)
{
    struct part parts[SPLIT_THREADS];
    int64_t half = (total / SPLIT_THREADS) & ~(int64_t)(ALIGNMENT - 1);
    size_t part_buf = (buf_size / SPLIT_THREADS) & ~(size_t)(ALIGNMENT - 1);
    if (part_buf > SERIAL_CHUNK)
        part_buf = SERIAL_CHUNK;
    for (int i = 0; i < SPLIT_THREADS; i++) {
        int64_t start = half * i;
        parts[i] = (struct part){
            .src_fd = src_fd,
            .dst_fd = dst_fd,
            .src_off = src_off + start,
            .dst_off = dst_off + start,
            .len = i == SPLIT_THREADS - 1 ? total - start : half,
            .buf = buf + (size_t)i * part_buf,
            .buf_size = part_buf,
            .with_crc = with_crc,
            .failed_fd = -1,
        };
    }
    pthread_t helper;
    if (create_quiet_thread(&helper, NULL, copy_part, &parts[1]) != 0)
        return -1;
    copy_part(&parts[0]);
    pthread_join(helper, NULL);
    for (int i = 0; i < SPLIT_THREADS; i++) {
        if (parts[i].err) {
            *failed_fd = parts[i].failed_fd;
            return parts[i].err;
        }
    }
    /* The result is the contiguous prefix copied: a part that stopped short
     * (the file shrank) ends it. */
    *copied = 0;
    *crc = 0;
    for (int i = 0; i < SPLIT_THREADS; i++) {
        *crc = with_crc ? bbio_crc32c_combine(*crc, parts[i].crc, parts[i].copied) : 0;
        *copied += parts[i].copied;
        if (parts[i].copied < parts[i].len)
            break;
    }
    return 0;
}

/* A second thread only pays off with a second CPU to run on. */
static int cpus_available(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0)
        return 1;
    return CPU_COUNT(&set);
}

static int64_t bytes_to_copy(int src_fd, int64_t src_off, int64_t len)
{
    struct stat st;
    if (len >= 0)
        return len;
    if (fstat(src_fd, &st) != 0 || !S_ISREG(st.st_mode))
        return 0;
    return st.st_size > src_off ? st.st_size - src_off : 0;
}

int bbio_copy_range(int src_fd, int dst_fd, int64_t src_off, int64_t dst_off,
                    int64_t len, void *buf, size_t buf_size, int flags,
                    int64_t *copied, uint32_t *crc, int *failed_fd)
{
    *copied = 0;
    *crc = 0;
    *failed_fd = -1;
    if (src_off < 0 || dst_off < 0)
        return EINVAL;
    if (!(flags & (BBIO_COPY_CRC | BBIO_COPY_NO_COPY_FILE_RANGE))) {
        int unsupported = 0;
        int err = copy_kernel(src_fd, dst_fd, src_off, dst_off, len, copied,
                              failed_fd, &unsupported);
        if (err || !unsupported)
            return err;
    }
    void *owned = NULL;
    if (buf == NULL || buf_size < ALIGNMENT) {
        buf_size = DEFAULT_BUFFER_SIZE;
        if (posix_memalign(&owned, ALIGNMENT, buf_size) != 0)
            return ENOMEM;
        buf = owned;
    }
    int with_crc = flags & BBIO_COPY_CRC;
    int err = -1;
    int64_t total = bytes_to_copy(src_fd, src_off, len);
    if (!(flags & BBIO_COPY_SEQUENTIAL) && total >= SPLIT_MIN_BYTES &&
        buf_size >= SPLIT_THREADS * (size_t)ALIGNMENT && cpus_available() >= 2)
        err = copy_split(src_fd, dst_fd, src_off, dst_off, total, buf, buf_size,
                         with_crc, copied, crc, failed_fd);
    if (err < 0)
        err = copy_buffered(src_fd, dst_fd, src_off, dst_off, len, buf,
                            buf_size < SERIAL_CHUNK ? buf_size : SERIAL_CHUNK,
                            with_crc, copied, crc, failed_fd);
    free(owned);
    return err;
}

#define PWRITE_CRC_CHUNK (256 << 10) /* written, then CRC'd while still in L2 */

int bbio_pwrite_crc(int fd, const void *buf, int64_t len, int64_t off, uint32_t *crc)
{
    const unsigned char *p = buf;
    *crc = 0;
    if (len < 0 || off < 0)
        return EINVAL;
    while (len > 0) {
        size_t n = len < PWRITE_CRC_CHUNK ? (size_t)len : PWRITE_CRC_CHUNK;
        int err = pwrite_all(fd, p, n, off);
        if (err)
            return err;
        *crc = bbio_crc32c(*crc, p, n);
        p += n;
        off += (int64_t)n;
        len -= (int64_t)n;
    }
    return 0;
}

int bbio_map_shared(int fd, int64_t offset, int64_t len, void **addr)
{
    long page = sysconf(_SC_PAGESIZE);
    *addr = NULL;
    if (len <= 0 || offset < 0 || page <= 0 || offset % page)
        return EINVAL;
    void *map = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     (off_t)offset);
    if (map == MAP_FAILED)
        return errno;
    if (madvise(map, (size_t)len, MADV_DONTFORK)) {
        int err = errno;
        munmap(map, (size_t)len);
        return err;
    }
    *addr = map;
    return 0;
}

int bbio_unmap(void *addr, int64_t len)
{
    if (len <= 0)
        return EINVAL;
    return munmap(addr, (size_t)len) ? errno : 0;
}

#define COPY_CRC_CHUNK (256 << 10) /* copied, then CRC'd while still in L2 */

int bbio_copy_crc(void *dst, const void *src, int64_t len, uint32_t *crc)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    *crc = 0;
    if (len < 0)
        return EINVAL;
    while (len > 0) {
        size_t n = len < COPY_CRC_CHUNK ? (size_t)len : COPY_CRC_CHUNK;
        memcpy(d, s, n);
        *crc = bbio_crc32c(*crc, d, n);
        d += n;
        s += n;
        len -= (int64_t)n;
    }
    return 0;
}

int bbio_fs_magic(int fd, int64_t *magic)
{
    struct statfs info;
    *magic = 0;
    if (fstatfs(fd, &info))
        return errno;
    *magic = (int64_t)info.f_type;
    return 0;
}

/* A pool of worker threads, created on first need and kept: batched calls
 * come every training step, and creating threads each time costs more than the
 * small reads they do.  One batch runs at a time; the calling thread works too.
 * If threads cannot be created, fewer (or none) help: nothing fails for lack
 * of threads. */
static pthread_mutex_t pool_call = PTHREAD_MUTEX_INITIALIZER; /* one batch at a time */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;
static int pool_threads;          /* workers alive */
static uint64_t pool_generation;  /* bumped for each batch */
static int pool_wanted;           /* workers still to join the current batch */
static int pool_active;           /* workers that joined and have not finished */
static void *(*pool_fn)(void *);
static void *pool_arg;
static pthread_once_t pool_fork_once = PTHREAD_ONCE_INIT;

/* A forked child has none of the parent's workers, only the thread that forked
 * (PyTorch's DataLoader workers, for one): it starts with an empty pool and new
 * locks, which another thread of the parent may have held at the fork. */
static void pool_reset_in_child(void)
{
    pthread_mutex_init(&pool_call, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_work, NULL);
    pthread_cond_init(&pool_done, NULL);
    pool_threads = 0;
    pool_wanted = 0;
    pool_active = 0;
}

static void pool_watch_forks(void)
{
    pthread_atfork(NULL, NULL, pool_reset_in_child);
}

/* arg: the generation current when the worker was created; it joins the
 * batches that come after it (its first one is being set up by its creator). */
static void *pool_worker(void *created_at)
{
    uint64_t seen = (uint64_t)(uintptr_t)created_at;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (pool_generation == seen)
            pthread_cond_wait(&pool_work, &pool_mu);
        seen = pool_generation;
        if (pool_wanted <= 0)
            continue;
        pool_wanted--;
        void *(*fn)(void *) = pool_fn;
        void *arg = pool_arg;
        pthread_mutex_unlock(&pool_mu);
        fn(arg);
        pthread_mutex_lock(&pool_mu);
        if (--pool_active == 0)
            pthread_cond_signal(&pool_done);
    }
    return NULL;
}

/* Run worker(arg) on up to nthreads threads (never more than jobs). */
static void run_workers(void *(*worker)(void *), void *arg, int nthreads, int64_t jobs)
{
    if ((int64_t)nthreads > jobs)
        nthreads = (int)jobs;
    int helpers = nthreads > 1 ? nthreads - 1 : 0;
    if (helpers == 0) {
        worker(arg);
        return;
    }
    pthread_once(&pool_fork_once, pool_watch_forks);
    pthread_mutex_lock(&pool_call);
    pthread_mutex_lock(&pool_mu);
    while (pool_threads < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        if (pthread_attr_init(&attr) != 0)
            break;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = create_quiet_thread(&thread, &attr, pool_worker,
                                         (void *)(uintptr_t)pool_generation);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        pool_threads++;
    }
    if (helpers > pool_threads)
        helpers = pool_threads;
    pool_fn = worker;
    pool_arg = arg;
    pool_wanted = helpers;
    pool_active = helpers;
    pool_generation++;
    pthread_cond_broadcast(&pool_work);
    pthread_mutex_unlock(&pool_mu);
    worker(arg);
    pthread_mutex_lock(&pool_mu);
    while (pool_active > 0)
        pthread_cond_wait(&pool_done, &pool_mu);
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_call);
}

/* ------------------------------------------------------ batched file copies */

struct file_batch {
    const char *const *src;
    const char *const *dst;
    int64_t count;
    size_t buf_size;
    int flags;
    const uint32_t *modes;
    const int64_t *mtimes_ns;
    int64_t *copied;
    uint32_t *crcs;
    int *errors;
    int *failed_side;
    int64_t *size_after;
    int64_t *mtime_ns_after;
    int64_t next; /* advanced atomically */
};

/* failed_side values: which side of a copy failed. */
#define SIDE_SOURCE 0
#define SIDE_DESTINATION 1
#define SIDE_SOURCE_NOT_REGULAR 2 /* gone, or replaced by a symlink, FIFO, directory */

/* open and fsync, retried when a signal interrupts them (EINTR): the thread that
 * calls in from Python copies too, and receives the job's signals; on a FUSE or NFS
 * file system a signal interrupts the call instead of waiting for it. */
static int open_retry(const char *path, int flags, mode_t mode)
{
    int fd;
    do
        fd = open(path, flags, mode);
    while (fd < 0 && errno == EINTR);
    return fd;
}

static int fsync_retry(int fd)
{
    int result;
    do
        result = fsync(fd);
    while (result != 0 && errno == EINTR);
    return result;
}

/* The source opened as the regular file a walk found: a symlink in its last
 * component is not followed, a FIFO does not block the open. */
static int open_regular_source(const char *path, int *side)
{
    int fd = open_retry(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0);
    if (fd < 0) {
        int err = errno;
        *side = (err == ENOENT || err == ENOTDIR || err == ELOOP) ? SIDE_SOURCE_NOT_REGULAR
                                                                  : SIDE_SOURCE;
        errno = err;
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        *side = SIDE_SOURCE;
        errno = err;
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        *side = SIDE_SOURCE_NOT_REGULAR;
        errno = EINVAL;
        return -1;
    }
    return fd;
}

static void copy_one_file(struct file_batch *b, int64_t i, void *buf)
{
    b->errors[i] = 0;
    b->failed_side[i] = SIDE_SOURCE;
    int src_fd = open_regular_source(b->src[i], &b->failed_side[i]);
    if (src_fd < 0) {
        b->errors[i] = errno;
        return;
    }
    int dst_fd = open_retry(b->dst[i], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (dst_fd < 0) {
        b->errors[i] = errno;
        b->failed_side[i] = SIDE_DESTINATION;
        close(src_fd);
        return;
    }
    int failed_fd = -1;
    int err = bbio_copy_range(src_fd, dst_fd, 0, 0, -1, buf, b->buf_size,
                              b->flags, &b->copied[i], &b->crcs[i], &failed_fd);
    struct stat st;
    if (!err && fstat(src_fd, &st) != 0)
        err = errno;
    if (!err && b->modes) {
        struct timespec times[2];
        int64_t sec = b->mtimes_ns[i] / 1000000000, nsec = b->mtimes_ns[i] % 1000000000;
        if (nsec < 0) { /* before 1970: the nanoseconds must be 0..999999999 */
            nsec += 1000000000;
            sec -= 1;
        }
        times[0].tv_sec = times[1].tv_sec = (time_t)sec;
        times[0].tv_nsec = times[1].tv_nsec = (long)nsec;
        if (fchmod(dst_fd, (mode_t)(b->modes[i] & 07777)) != 0 ||
            futimens(dst_fd, times) != 0 || fsync_retry(dst_fd) != 0) {
            err = errno;
            failed_fd = dst_fd;
        }
    }
    if (err) {
        b->errors[i] = err;
        b->failed_side[i] = failed_fd == dst_fd;
    } else {
        b->size_after[i] = st.st_size;
        b->mtime_ns_after[i] = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    }
    if (close(dst_fd) != 0 && !b->errors[i]) {
        b->errors[i] = errno;
        b->failed_side[i] = SIDE_DESTINATION;
    }
    close(src_fd);
}

static void *file_batch_worker(void *arg)
{
    struct file_batch *b = arg;
    void *buf = NULL;
    if (posix_memalign(&buf, ALIGNMENT, b->buf_size) != 0)
        buf = NULL; /* bbio_copy_range then allocates its own */
    for (;;) {
        int64_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->count)
            break;
        copy_one_file(b, i, buf);
    }
    free(buf);
    return NULL;
}

int bbio_copy_files(const char *const *src, const char *const *dst, int64_t count,
                    int nthreads, size_t buf_size, int flags,
                    const uint32_t *modes, const int64_t *mtimes_ns, int64_t *copied,
                    uint32_t *crcs, int *errors, int *failed_side,
                    int64_t *size_after, int64_t *mtime_ns_after)
{
    struct file_batch b = {src, dst, count,
                           buf_size < ALIGNMENT ? DEFAULT_BUFFER_SIZE : buf_size,
                           flags, mtimes_ns ? modes : NULL, modes ? mtimes_ns : NULL,
                           copied, crcs, errors, failed_side, size_after,
                           mtime_ns_after, 0};
    if (count < 0)
        return EINVAL;
    run_workers(file_batch_worker, &b, nthreads, count);
    return 0;
}

/* ------------------------------------------------------------ batched reads */

struct batch {
    const int *fds;
    const int64_t *offsets;
    const int64_t *lengths;
    const int64_t *out_offsets;
    const uint8_t *aligned;
    int64_t count;
    unsigned char *out;
    int64_t *results;
    int64_t next;     /* next request to claim, advanced atomically */
    int64_t failures; /* advanced atomically */
};

/* Read up to len bytes at off into buf, short only at end of file; -errno.  With
 * aligned (an aligned range, maybe through O_DIRECT), a read that ends off a page
 * boundary at the file's end ends it: reading on from there would be unaligned, which
 * kernels before 5.5 refuse (EINVAL) and pread_retry would answer by dropping O_DIRECT
 * from the descriptor for good.  (A short read before the end, which a FUSE daemon
 * may give, is read on from.) */
static int64_t pread_full(int fd, unsigned char *buf, int64_t len, int64_t off, int aligned)
{
    int64_t done = 0;
    while (done < len) {
        ssize_t n = pread_retry(fd, buf + done, (size_t)(len - done), off + done);
        if (n < 0)
            return -(int64_t)errno;
        if (n == 0)
            break;
        done += n;
        if (aligned && done % ALIGNMENT != 0) {
            struct stat st;
            if (fstat(fd, &st) == 0 && (int64_t)st.st_size <= off + done)
                break;
        }
    }
    return done;
}

/* Each reading thread's bounce buffer for aligned reads, kept for its next
 * ones and freed when the thread exits. */
struct bounce {
    unsigned char *buf;
    size_t cap;
};
static pthread_key_t bounce_key;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;

static void bounce_free(void *arg)
{
    struct bounce *held = arg;
    free(held->buf);
    free(held);
}

static void bounce_key_make(void)
{
    pthread_key_create(&bounce_key, bounce_free);
}

static unsigned char *bounce(size_t need)
{
    pthread_once(&bounce_once, bounce_key_make);
    struct bounce *held = pthread_getspecific(bounce_key);
    if (held == NULL) {
        held = calloc(1, sizeof *held);
        if (held == NULL)
            return NULL;
        if (pthread_setspecific(bounce_key, held) != 0) {
            free(held);
            return NULL;
        }
    }
    if (need > held->cap) {
        void *grown;
        if (posix_memalign(&grown, ALIGNMENT, need) != 0)
            return NULL;
        free(held->buf);
        held->buf = grown;
        held->cap = need;
    }
    return held->buf;
}

/* The aligned range around the request, read into the bounce buffer. */
static int64_t pread_aligned(int fd, unsigned char *dst, int64_t want, int64_t off)
{
    if (want == 0)
        return 0; /* no bounce buffer needed (nor made) */
    if (off > INT64_MAX - want)
        return -EINVAL; /* as pread says of a range past the largest file offset */
    int64_t start = off & ~(int64_t)(ALIGNMENT - 1);
    int64_t last_page = INT64_MAX & ~(int64_t)(ALIGNMENT - 1);
    int64_t end = off + want > last_page ? last_page
                                         : (off + want + ALIGNMENT - 1) & ~(int64_t)(ALIGNMENT - 1);
    if (end <= start)
        return 0; /* in the last page a file offset can name: no file holds bytes there */
    unsigned char *tmp = bounce((size_t)(end - start));
    if (tmp == NULL)
        return -ENOMEM;
    int64_t got = pread_full(fd, tmp, end - start, start, 1);
    if (got < 0)
        return got;
    int64_t avail = got - (off - start);
    if (avail < 0)
        avail = 0;
    if (avail > want)
        avail = want;
    memcpy(dst, tmp + (off - start), (size_t)avail);
    return avail;
}

static void read_one(struct batch *b, int64_t i)
{
    unsigned char *dst = b->out + b->out_offsets[i];
    int64_t want = b->lengths[i];
    if (want < 0 || b->offsets[i] < 0) {
        b->results[i] = -EINVAL;
        __atomic_fetch_add(&b->failures, 1, __ATOMIC_RELAXED);
        return;
    }
    int64_t got = b->aligned && b->aligned[i]
                      ? pread_aligned(b->fds[i], dst, want, b->offsets[i])
                      : pread_full(b->fds[i], dst, want, b->offsets[i], 0);
    if (got < 0)
        __atomic_fetch_add(&b->failures, 1, __ATOMIC_RELAXED);
    b->results[i] = got;
}

static void *batch_worker(void *arg)
{
    struct batch *b = arg;
    for (;;) {
        int64_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->count)
            return NULL;
        read_one(b, i);
    }
}

int bbio_pread_batch(const int *fds, const int64_t *offsets,
                     const int64_t *lengths, const int64_t *out_offsets,
                     const uint8_t *aligned, int64_t count, void *out,
                     int nthreads, int64_t *results, int64_t *failures)
{
    struct batch b = {fds, offsets, lengths, out_offsets, aligned, count, out,
                      results, 0, 0};
    *failures = 0;
    if (count < 0)
        return EINVAL;
    run_workers(batch_worker, &b, nthreads, count);
    *failures = b.failures;
    return 0;
}

/* --------------------------------------------------------------- fallocate */

int bbio_fallocate(int fd, int64_t offset, int64_t len, int keep_size)
{
    int mode = keep_size ? FALLOC_FL_KEEP_SIZE : 0;
    while (fallocate(fd, mode, (off_t)offset, (off_t)len) != 0) {
        if (errno != EINTR)
            return errno;
    }
    return 0;
}
