"""The write path: from ``produce()`` / ``ingest()`` to an entry in the queue manifest.

| module | what it holds |
|---|---|
| `handles.py` | `WriteHandle`, `Durability` (LOCAL, REMOTE), `DurabilityWatcher` |
| `producer.py` | the stateless producer (RFC 0001): batches in memory, uploads, appends |
| `publish.py` | upload a data object (create-if-absent), append it to the manifest exactly once |
| `staged.py` | the staged producer: the local tier (WAL, segments) in front of the exporter |
| `stage_binding.py` | a stage belongs to one buffer (`buffer.json`) |
| `exporter.py` | uploads sealed segments and appends them; releases them from the stage |
| `prompt_seal.py` | a wait for REMOTE asks for an early seal |
| `fanin.py` | the commit hub: one commit per interval for every writer of a buffer (fan-in) |
| `announcements.py` | the committer's reader of other processes' announcements |
| `rhythm.py` | when a watcher polls for the holder's next commit (pure) |
| `api.py` | the `RecordProducer` protocol both producers meet |
"""
