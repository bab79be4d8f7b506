"""The client of ``tieredbuf serve``: the producer API over HTTP.

``tieredbuf.service_producer("http://host1:8080,host2:8080", token_file=...)`` returns a
:class:`~tieredbuf.client.producer.ServiceProducer`: ``produce()`` gives a
``WriteHandle`` (LOCAL and REMOTE, REMOTE naming the entry), batches are sent as one
request each, retried under one ``Idempotency-Key`` across the instances.

| module | what it holds |
|---|---|
| `producer.py` | `ServiceProducer`: batching, backpressure, senders, handles, `flush` / `close` |
| `request.py` | one request's life: attempts under one key, what a 200 proves (I10) |
| `policy.py` | decisions (no I/O): which answers are retried, how long after, where to |
| `transport.py` | one attempt over `http.client`: keep-alive connections, TLS, the bearer token |
| `endpoints.py` | service URLs: `http(s)://host:port[,host2:port2][/path]` (pure) |
"""
