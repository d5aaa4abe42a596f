// W6 candidate for Apache Curator's LeaderLatch (dlock-bench --w6-peer): joins the latch at
// PATH, prints one line the moment it leads, then leads until killed.
//
//   javac -cp /usr/share/java/curator-recipes.jar LeaderLatchCandidate.java
//   java -cp .:<curator classpath> LeaderLatchCandidate CONNECT PATH SESSION_MS ID
//
// `cargo xtask bench` compiles it and passes the command line to dlock-bench.
import java.util.concurrent.CountDownLatch;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.retry.ExponentialBackoffRetry;

public final class LeaderLatchCandidate {
    public static void main(String[] args) throws Exception {
        if (args.length != 4) {
            System.err.println("usage: LeaderLatchCandidate CONNECT PATH SESSION_MS ID");
            System.exit(2);
        }
        String path = args[1].startsWith("/") ? args[1] : "/" + args[1];
        int sessionMs = Integer.parseInt(args[2]);
        CuratorFramework client = CuratorFrameworkFactory.newClient(
                args[0], sessionMs, 3000, new ExponentialBackoffRetry(100, 3));
        client.start();
        LeaderLatch latch = new LeaderLatch(client, path, "candidate-" + args[3]);
        latch.start();
        latch.await();
        System.out.println("leading " + latch.getId());
        System.out.flush();
        // Lead until killed (the bench SIGKILLs the leader: no close, no resignation).
        new CountDownLatch(1).await();
    }
}
