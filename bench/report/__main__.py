from bench.report.pages import main

raise SystemExit(main())
