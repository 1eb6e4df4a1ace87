"""`python -m buffer --config-json FILE --run-dir DIR`: run the buffer service (see buffer/service.py)."""

from buffer.service import main

raise SystemExit(main())
