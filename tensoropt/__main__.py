from tensoropt.cli import main

raise SystemExit(main())
