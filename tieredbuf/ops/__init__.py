"""Operations: what runs beside the roles.

| module | what it holds |
|---|---|
| `gc.py` | garbage collection of unreferenced objects (`tieredbuf gc`, from cron) |
| `metrics.py` | Prometheus metrics of producers, consumers, buffers and GC passes |
| `series.py` | every exported series, by the stats key it comes from (pure data) |
| `verify.py` | the scrub: read every live object and check it (`tieredbuf verify`) |
"""
