//! The `.log` file of one segment: record batches back to back, appended at the end.
//!
//! Writes go to the end with positioned writes; readers use positioned reads through a
//! shared handle, so a read never moves a cursor the writer depends on. `size` is the
//! number of bytes holding complete batches: bytes past it (a torn write) are not
//! visible through this type and are cut off by recovery.
//!
//! The descriptor is opened on first use and may be released when idle
//! ([`LogFile::close_if_idle`], for sealed segments): a broker with many segments holds
//! descriptors only for the files in use, and the next use reopens the file by its path.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::index_file::remove_if_exists;

#[cfg(test)]
thread_local! {
    static FAIL_NEXT_APPEND: std::cell::Cell<Option<(usize, i32)>> = const { std::cell::Cell::new(None) };
}

/// Tests only: the next append on this thread writes its first `written` bytes, then
/// fails with `errno` (a short write, or none at all with 0).
#[cfg(test)]
pub(crate) fn fail_next_append(written: usize, errno: i32) {
    FAIL_NEXT_APPEND.with(|f| f.set(Some((written, errno))));
}

/// One segment's record-batch file.
#[derive(Debug)]
pub struct LogFile {
    path: PathBuf,
    /// The open descriptor; `None` once released until the next use.
    file: Mutex<Option<Arc<File>>>,
    /// Used since the last [`LogFile::close_if_idle`].
    used: AtomicBool,
    size: u64,
}

impl LogFile {
    /// Opens (or creates) `path`; every byte in the file counts until recovery says otherwise.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let size = file.metadata()?.len();
        Ok(Self {
            path: path.to_path_buf(),
            file: Mutex::new(Some(Arc::new(file))),
            used: AtomicBool::new(true),
            size,
        })
    }

    /// The open descriptor, reopening the file if it was released.
    fn file(&self) -> io::Result<Arc<File>> {
        self.used.store(true, Ordering::Relaxed);
        let mut slot = self.file.lock();
        if let Some(file) = &*slot {
            return Ok(Arc::clone(file));
        }
        let file = Arc::new(OpenOptions::new().read(true).write(true).open(&self.path)?);
        *slot = Some(Arc::clone(&file));
        Ok(file)
    }

    /// Releases the descriptor when the file was not used since the previous call;
    /// returns true when it did. Handles already given out stay valid.
    pub fn close_if_idle(&self) -> bool {
        if self.used.swap(false, Ordering::Relaxed) {
            return false;
        }
        self.file.lock().take().is_some()
    }

    /// Releases the descriptor now (the next use reopens the file).
    pub fn release(&self) {
        self.used.store(false, Ordering::Relaxed);
        self.file.lock().take();
    }

    /// True while a descriptor is open.
    pub fn is_open(&self) -> bool {
        self.file.lock().is_some()
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes in the file.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// A shared handle for positioned reads (and fsync) without holding the log's lock.
    pub fn handle(&self) -> io::Result<Arc<File>> {
        self.file()
    }

    /// Appends `data` at the end; returns the position it was written at.
    pub fn append(&mut self, data: &[u8]) -> io::Result<u64> {
        let position = self.size;
        let file = self.file()?;
        #[cfg(test)]
        if let Some((written, errno)) = FAIL_NEXT_APPEND.with(|f| f.take()) {
            file.write_all_at(&data[..written.min(data.len())], position)?;
            return Err(io::Error::from_raw_os_error(errno));
        }
        file.write_all_at(data, position)?;
        self.size += data.len() as u64;
        Ok(position)
    }

    /// Reads into `buf` from `position`, stopping at the end of the file.
    pub fn read_at(&self, position: u64, buf: &mut [u8]) -> io::Result<usize> {
        read_at_most(&*self.file()?, position, buf)
    }

    /// Flushes written data to disk (fdatasync).
    pub fn flush(&self) -> io::Result<()> {
        self.file()?.sync_data()
    }

    /// Cuts the file to `size` bytes.
    pub fn truncate_to(&mut self, size: u64) -> io::Result<()> {
        let file = self.file()?;
        if size < self.size || file.metadata()?.len() != size {
            file.set_len(size)?;
        }
        self.size = size;
        Ok(())
    }

    /// Renames the file, e.g. to add the `.deleted` suffix.
    pub fn rename(&mut self, to: &Path) -> io::Result<()> {
        std::fs::rename(&self.path, to)?;
        self.path = to.to_path_buf();
        Ok(())
    }

    /// Removes the file from disk; open handles keep working until dropped.
    pub fn delete(&self) -> io::Result<()> {
        remove_if_exists(&self.path)
    }
}

/// Positioned read of up to `len` bytes into a new buffer, stopping at the end of the
/// file. The buffer is not zero-filled first (a fetch reads megabytes; a memset of each
/// would cost about as much as the copy from the page cache).
///
/// With `cached_only` the read never waits for the disk (`preadv2` with `RWF_NOWAIT`):
/// it fails with [`io::ErrorKind::WouldBlock`] unless all `len` bytes (or all up to the
/// end of the file) are in the page cache, so an async task may call it.
pub fn read_vec_at_most(
    file: &File,
    position: u64,
    len: usize,
    cached_only: bool,
) -> io::Result<Vec<u8>> {
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    // SAFETY: the spare capacity holds `len` bytes, which the read only writes to.
    let n = unsafe { pread_into(file, position, buf.as_mut_ptr(), len, cached_only)? };
    // SAFETY: the first `n` bytes were written by the read.
    unsafe { buf.set_len(n) };
    Ok(buf)
}

/// [`read_at_most`], or with `cached_only` one that fails with
/// [`io::ErrorKind::WouldBlock`] instead of waiting for the disk (see
/// [`read_vec_at_most`]).
pub fn read_at_most_with(
    file: &File,
    position: u64,
    buf: &mut [u8],
    cached_only: bool,
) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    unsafe { pread_into(file, position, buf.as_mut_ptr(), buf.len(), cached_only) }
}

/// Reads up to `len` bytes at `position` into `ptr` (`preadv2`, with `RWF_NOWAIT` when
/// `cached_only`), retrying short reads until `len` or the end of the file; returns the
/// bytes read.
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes.
unsafe fn pread_into(
    file: &File,
    position: u64,
    ptr: *mut u8,
    len: usize,
    cached_only: bool,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let flags = if cached_only { libc::RWF_NOWAIT } else { 0 };
    let mut done = 0usize;
    while done < len {
        let at = libc::off_t::try_from(position + done as u64)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let iov = libc::iovec {
            // SAFETY: `done < len`, so the pointer stays inside the caller's buffer.
            iov_base: unsafe { ptr.add(done) }.cast(),
            iov_len: len - done,
        };
        // SAFETY: the iovec describes writable memory the caller vouched for.
        let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, at, flags) };
        match n {
            0 => break,
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => {}
                    // Not cached (EAGAIN is WouldBlock already), or a kernel/file system
                    // without RWF_NOWAIT.
                    _ if cached_only
                        && matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) =>
                    {
                        return Err(io::ErrorKind::WouldBlock.into())
                    }
                    _ => return Err(e),
                }
            }
        }
    }
    Ok(done)
}

/// Positioned read that fills as much of `buf` as the file has.
pub fn read_at_most(file: &File, position: u64, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], position + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_vec_stops_at_the_end_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        let file = File::open(&path).unwrap();
        // A file system without RWF_NOWAIT answers every cache-only read "would block"
        // (callers then read on a blocking thread): check only what it supports.
        let nowait = read_vec_at_most(&file, 0, 1, true).is_ok();
        for cached_only in [false, true].into_iter().filter(|c| !c || nowait) {
            // (Just written: in the page cache.)
            assert_eq!(
                read_vec_at_most(&file, 2, 5, cached_only).unwrap(),
                b"23456"
            );
            assert_eq!(
                read_vec_at_most(&file, 7, 100, cached_only).unwrap(),
                b"789"
            );
            assert!(read_vec_at_most(&file, 20, 4, cached_only)
                .unwrap()
                .is_empty());
        }
    }
}
