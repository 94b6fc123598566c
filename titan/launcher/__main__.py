from titan.launcher.launch import main

main()
