/* Declarations only: this file is both #included by bbio_native.c and fed to
 * cffi's cdef(), so it holds no preprocessor logic.  Every function returns 0
 * or a positive errno value; results come back through OUT pointers.  None of
 * them aborts the process, and all of them are safe to call without the GIL. */

/* CRC32C (Castagnoli).  IN crc: the CRC of the bytes before buf (0 to start).
 * The dispatcher uses SSE4.2 when the CPU has it, slicing-by-8 tables otherwise. */
uint32_t bbio_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t bbio_crc32c_sw(uint32_t crc, const void *buf, size_t len);
uint32_t bbio_crc32c_hw(uint32_t crc, const void *buf, size_t len);
int bbio_crc32c_hw_available(void);
/* The CRC32C of A followed by B, from crc1 = CRC(A), crc2 = CRC(B), len2 = |B|. */
uint32_t bbio_crc32c_combine(uint32_t crc1, uint32_t crc2, int64_t len2);

/* Copy up to len bytes (len < 0: to end of file) from src_fd at src_off to
 * dst_fd at dst_off, stopping early at end of file.
 * IN  buf, buf_size: scratch buffer (NULL: allocate one, 4096-aligned).
 * IN  flags: BBIO_COPY_* bits.
 * OUT copied: bytes copied; crc: CRC32C of those bytes when BBIO_COPY_CRC;
 *     failed_fd: on error, the descriptor whose call failed.
 * With BBIO_COPY_CRC the bytes pass through buf once (pread, CRC, pwrite);
 * copies of 8 MiB or more use two threads, one per half, when the process may
 * run on two CPUs, unless BBIO_COPY_SEQUENTIAL asks for one thread writing in
 * file order.  Without BBIO_COPY_CRC, copy_file_range is used when the kernel
 * supports it. */
int bbio_copy_range(int src_fd, int dst_fd, int64_t src_off, int64_t dst_off,
                    int64_t len, void *buf, size_t buf_size, int flags,
                    int64_t *copied, uint32_t *crc, int *failed_fd);

#define BBIO_COPY_CRC 1
#define BBIO_COPY_NO_COPY_FILE_RANGE 2
#define BBIO_COPY_SEQUENTIAL 4

/* Write len bytes of buf into fd at off (retrying short writes), with their
 * CRC32C computed in the same pass, a chunk at a time while it is in cache.
 * OUT crc: the CRC32C of the bytes (of those written before an error). */
int bbio_pwrite_crc(int fd, const void *buf, int64_t len, int64_t off, uint32_t *crc);

/* Map len bytes of fd from offset (a multiple of the page size) shared and
 * writable, left out of forked children (MADV_DONTFORK).  OUT addr.
 * bbio_unmap undoes it. */
int bbio_map_shared(int fd, int64_t offset, int64_t len, void **addr);
int bbio_unmap(void *addr, int64_t len);

/* Copy len bytes from src to dst (a mapping of a file) a chunk at a time,
 * each chunk's CRC32C computed from dst while it is in cache.  OUT crc. */
int bbio_copy_crc(void *dst, const void *src, int64_t len, uint32_t *crc);

/* The file system type of fd (statfs' f_type, such as 0x01021994 for tmpfs).
 * OUT magic. */
int bbio_fs_magic(int fd, int64_t *magic);

/* Copy count whole files, nthreads at a time: src[i] into dst[i] (created
 * or truncated, mode 0600), CRC32C in the same pass when BBIO_COPY_CRC.
 * IN  modes, mtimes_ns (both NULL, or both set): then each copy is sealed
 *     once written: chmod modes[i], mtime mtimes_ns[i], fsync.
 * Sources are opened without following a symlink in their last component
 * and without blocking (a FIFO), and must be regular files.
 * OUT copied[i], crcs[i]; errors[i]: 0 or errno, failed_side[i]: 0 source,
 *     1 destination, 2 the source is gone or no longer a regular file (nothing
 *     copied, no destination made); size_after[i], mtime_ns_after[i]: the
 *     source's fstat once copied (to detect a file that changed meanwhile). */
int bbio_copy_files(const char *const *src, const char *const *dst, int64_t count,
                    int nthreads, size_t buf_size, int flags,
                    const uint32_t *modes, const int64_t *mtimes_ns, int64_t *copied,
                    uint32_t *crcs, int *errors, int *failed_side,
                    int64_t *size_after, int64_t *mtime_ns_after);

/* Reserve len bytes of fd from offset with fallocate(2): never glibc's
 * posix_fallocate emulation, which writes a byte into every block where the
 * file system cannot reserve space.  keep_size: the file's size stays as it is
 * (FALLOC_FL_KEEP_SIZE; a truncate to its size frees what writes did not use).
 * Returns 0 or errno (EOPNOTSUPP: the file system cannot; ENOSPC: the device is
 * full). */
int bbio_fallocate(int fd, int64_t offset, int64_t len, int keep_size);

/* Batched positional reads: request i reads lengths[i] bytes of fds[i] at
 * offsets[i] into out + out_offsets[i].  nthreads threads keep requests in
 * flight.  A request with aligned[i] set (aligned may be NULL: none) reads the
 * 4096-byte-aligned range around it into a per-thread bounce buffer and copies
 * its bytes out, as an O_DIRECT descriptor needs.  OUT results[i]: bytes read
 * (less than lengths[i] only at end of file) or -errno.  OUT failures: how
 * many requests failed. */
int bbio_pread_batch(const int *fds, const int64_t *offsets,
                     const int64_t *lengths, const int64_t *out_offsets,
                     const uint8_t *aligned, int64_t count, void *out,
                     int nthreads, int64_t *results, int64_t *failures);
