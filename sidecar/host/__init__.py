"""The node's processes and files, where root's authority is used: who a caller is (peer
credentials, pidfds, pid namespaces), process facts, the one safety check before every signal,
and the files the sidecar creates in its diagnostics directory (private directories, stack-dump
files read back by inode).

The bottom room: it imports nothing of the sidecar but the shared top-level modules.
"""
