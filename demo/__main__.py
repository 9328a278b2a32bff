from demo.narrate import main

raise SystemExit(main())
