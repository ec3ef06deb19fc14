from fp8kv.cli import main

main()
