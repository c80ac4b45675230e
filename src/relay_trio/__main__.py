from relay_trio.cli import main

raise SystemExit(main())
