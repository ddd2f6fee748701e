from ratchet.cli import main

main()
