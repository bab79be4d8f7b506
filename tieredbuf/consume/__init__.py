"""The read path: subscribers, work-queue workers and plain readers of the queue.

| module | what it holds |
|---|---|
| `consumer.py` | the fenced consumer of one subscriber (default or named), `ConsumedBatch` |
| `worker.py` | a worker of a shared work queue: claim / ack / defer / reject under leases |
| `refill.py` | a worker's refill: the progress CAS that applies its resolutions and leases more |
| `fetch.py` | data objects (read ahead, large ones in ranged GETs), checked before served |
| `reader.py` | readers that never fence: a tree walk from a position, and a continuous tail |
"""
