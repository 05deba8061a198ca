from streams.cli import main

raise SystemExit(main())
