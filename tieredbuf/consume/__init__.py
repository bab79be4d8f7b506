"""The read path: subscribers, work-queue workers and plain readers of the queue.

| module | what it holds |
|---|---|
| `consumer.py` | the fenced consumer of one subscriber (default or named), `ConsumedBatch` |
| `worker.py` | a worker of a shared work queue: claim / ack / defer / reject under leases |
| `holdings.py` | what a worker holds between CASes: leases, the hand-out line, buffered ops |
| `refill.py` | a worker's refill: the progress CAS that applies its resolutions and leases more |
| `pace.py` | how many entries a refill leases and when the next starts ahead (pure) |
| `claimwait.py` | the long poll of an idle `claim(timeout=...)`: footer, progress, due times |
| `fetch.py` | data objects (read ahead, large ones in ranged GETs), checked before served |
| `reader.py` | readers that never fence: a tree walk from a position, and a continuous tail |
"""
