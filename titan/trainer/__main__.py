from titan.trainer.train import main

main()
