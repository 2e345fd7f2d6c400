from spill.cli import main

raise SystemExit(main())
