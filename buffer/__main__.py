"""`python -m buffer --config-json FILE --run-dir DIR`: run the buffer service (see buffer/service.py)."""

from buffer.memory import configure_malloc

configure_malloc()  # before numpy and ZMQ are imported: they start threads (buffer/memory.py)

from buffer.service import main  # noqa: E402

raise SystemExit(main())
