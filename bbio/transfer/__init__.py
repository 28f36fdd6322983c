"""The transfer layer shared by staging and the checkpoint drain.

Every file moves the same way: copied with the native copy (CRC32C in the same
pass) into a temporary name next to its destination, its mode and mtime set,
fsynced, then renamed.  A manifest, written last by write-to-temp, fsync and
rename, records what was committed; nothing counts as committed until it does.
"""
