"""The write path: from ``produce()`` / ``ingest()`` to an entry in the queue manifest.

| module | what it holds |
|---|---|
| `handles.py` | `WriteHandle`, `Durability` (LOCAL, REMOTE), `DurabilityWatcher` |
| `producer.py` | the stateless producer (RFC 0001): batches in memory, uploads, appends |
| `publish.py` | upload a data object (create-if-absent), append it to the manifest exactly once |
| `staged.py` | the staged producer: the local tier (WAL, segments) in front of the exporter |
| `stage_binding.py` | a stage belongs to one buffer (`buffer.json`) |
| `exporter.py` | uploads sealed segments and appends them; releases them from the stage |
| `export_tracker.py` | a staged write's REMOTE outcome, its LOCAL ack or export first |
| `prompt_seal.py` | a wait for REMOTE asks for an early seal |
| `fanin.py` | the commit hub: one commit per interval for every writer of a buffer (fan-in) |
| `hub_state.py` | what the hub's parts share: the waiting groups, the root as last seen, timings |
| `lease.py` | the hub's view of the commit lease: holding it, its length, its heir |
| `commit_turn.py` | the holder's turn: LIST, read announcements, one CAS for every writer |
| `watch_turn.py` | a watcher's turn: announce, poll the root, announce again, measure clock skew |
| `settle.py` | the one place a write becomes REMOTE: its own entry found in a manifest (I10) |
| `refresh.py` | the GC grace rule as a writer keeps it: upload aging data again |
| `announcements.py` | the committer's reader of other processes' announcements |
| `rhythm.py` | when a watcher polls for the holder's next commit (pure) |
| `api.py` | the `RecordProducer` protocol both producers meet |
"""
