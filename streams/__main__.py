from memfilter.cli import main

raise SystemExit(main())
