from bench.device.run import main

raise SystemExit(main())
