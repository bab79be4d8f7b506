"""Small runtime helpers every layer may use; they know nothing of buffers.

| module | what it holds |
|---|---|
| `stats.py` | `Stats`: the thread-safe counters every role reports; `ewma` |
| `retry.py` | jittered exponential backoff, interruptible retry sleeps, `RetryLog` |
| `pools.py` | thread pools that start every thread when they are made |
| `forks.py` | what survives `fork()`: the obstore runtime does not; `ForkGuard` |
| `signals.py` | `SignalEvent`: what a Ctrl-C / SIGTERM handler may safely set |
| `fsutil.py` | `fsync_dir` |
| `redact.py` | secrets kept out of logs, errors and answers |
| `buffers.py` | a `bytes` filled in place: large objects assembled from parts without a copy |
"""
