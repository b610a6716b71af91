"""Multi-executor Spark tests (marker ``cluster``): each scenario runs in a child process
(``tests.support.spark_cluster_child``) that starts ``local-cluster[2,1,1024]`` (two executor JVMs),
since this test session already holds a SparkContext and a Python process can hold only one."""
