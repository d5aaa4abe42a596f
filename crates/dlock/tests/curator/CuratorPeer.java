// A real Apache Curator client that dlock's interop tests drive over stdin/stdout.
//
// The tests compile this file with javac at test time and run it as a child process
// against the test ZooKeeper ensemble, so dlock is checked against Curator's own
// recipes (InterProcessMutex, InterProcessReadWriteLock, InterProcessSemaphoreV2,
// InterProcessSemaphoreMutex, Revoker), not against a re-implementation of them.
//
// Usage: java -cp <dir>:/usr/share/java/curator-recipes.jar CuratorPeer <connect-string>
//
// Protocol: one command per line on stdin, one reply line per command on stdout, each
// reply starting with the command's id. Commands of one id run in order on that id's own
// thread (Curator's reentrancy is per thread, and InterProcessMutex must be released by
// the thread that took it); different ids run concurrently, all on one Curator session.
//
//   <id> mutex <path> [ms]      InterProcessMutex.acquire        -> ACQUIRED | TIMEOUT
//   <id> semmutex <path> [ms]   InterProcessSemaphoreMutex       -> ACQUIRED | TIMEOUT
//   <id> read <path> [ms]       InterProcessReadWriteLock read   -> ACQUIRED | TIMEOUT
//   <id> write <path> [ms]      InterProcessReadWriteLock write  -> ACQUIRED | TIMEOUT
//   <id> sem <path> <max> [ms]  InterProcessSemaphoreV2 lease    -> ACQUIRED <node> | TIMEOUT
//   <id> count <path> <n>       SharedCount at <path> set to n   -> COUNT <n>
//   <id> semshared <path> <count-path> [ms]
//                               InterProcessSemaphoreV2 sized by that SharedCount
//                                                                -> ACQUIRED <node> | TIMEOUT
//   <id> revocable <path> [ms]  revocable InterProcessMutex      -> ACQUIRED | TIMEOUT
//                               later, on a revocation request:  -> REVOKE_REQUESTED, RELEASED
//   <id> release                releases what <id> took last     -> RELEASED | NOT_HELD
//   <id> revoke <node-path>     Revoker.attemptRevoke            -> REVOKE_SENT
//   <id> children <path>        sorted child names               -> CHILDREN a,b,c | NONODE
//   <id> data <node-path>       node data as UTF-8               -> DATA <text> | NONODE
//   <id> participants <path>    InterProcessMutex participants   -> PARTICIPANTS <n>
//   <id> latch <path> <pid> [ms]
//                               LeaderLatch(path, pid).start(), then await([ms])
//                                                                -> LEADER | TIMEOUT
//                               (release closes the latch; "latch" again on the same
//                               id and path closes the earlier one first)
//   <id> latchstart <path> <pid>
//                               LeaderLatch started, not awaited -> STARTED
//   <id> leads                  hasLeadership() of the latch <id> started last
//                                                                -> LEADS true|false
//   <id> leader <path>          a LeaderLatch's getLeader() and getParticipants()
//                                                                -> LEADER <id> <n> | NOBODY <n>
//   <id> quit                   closes the session and exits     -> BYE
//
// Anything that throws answers "<id> ERROR <message>". Without [ms] an acquire waits
// forever. Output lines are written whole and flushed, so the reader never sees halves.

import java.nio.charset.StandardCharsets;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Collections;
import java.util.Deque;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.api.ACLProvider;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.framework.recipes.leader.Participant;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreMutex;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.framework.recipes.locks.Revoker;
import org.apache.curator.framework.recipes.shared.SharedCount;
import org.apache.curator.retry.ExponentialBackoffRetry;
import org.apache.zookeeper.KeeperException;
import org.apache.zookeeper.ZooDefs;
import org.apache.zookeeper.data.ACL;

public class CuratorPeer {
    /** Something one id holds and can give back. */
    interface Held {
        void release() throws Exception;
    }

    /** Per-id state, touched only on that id's thread. */
    static final class Slot {
        final String id;
        final ExecutorService thread;
        final Deque<Held> held = new ArrayDeque<>();
        final Map<String, InterProcessReadWriteLock> rw = new HashMap<>();
        final Map<String, InterProcessMutex> mutexes = new HashMap<>();
        /** The latch this id started last, if it is still open. */
        LeaderLatch latch;

        Slot(String id) {
            this.id = id;
            this.thread = Executors.newSingleThreadExecutor(r -> {
                Thread t = new Thread(r, "peer-" + id);
                t.setDaemon(true);
                return t;
            });
        }
    }

    static CuratorFramework client;
    static final Map<String, Slot> slots = new HashMap<>();
    /** Started SharedCounts by path, shared by every id (each keeps a watch). */
    static final Map<String, SharedCount> counts = new HashMap<>();

    static synchronized SharedCount count(String path, int seed) throws Exception {
        SharedCount c = counts.get(path);
        if (c == null) {
            c = new SharedCount(client, path, seed);
            c.start();
            counts.put(path, c);
        }
        return c;
    }

    static synchronized void say(String line) {
        System.out.println(line);
        System.out.flush();
    }

    public static void main(String[] args) throws Exception {
        if (args.length < 1) {
            System.err.println("usage: CuratorPeer <connect-string> [session-ms]");
            System.exit(64);
        }
        int sessionMs = args.length > 1 ? Integer.parseInt(args[1]) : 10000;
        CuratorFrameworkFactory.Builder builder = CuratorFrameworkFactory.builder()
                .connectString(args[0])
                .sessionTimeoutMs(sessionMs)
                .connectionTimeoutMs(5000)
                .retryPolicy(new ExponentialBackoffRetry(100, 5));
        // Digest credentials ("user:password") from the environment, with the ACL dlock
        // gives its nodes under credentials: creator all, world read.
        String digest = System.getenv("DLOCK_CURATOR_DIGEST");
        if (digest != null && !digest.isEmpty()) {
            final List<ACL> acl = new ArrayList<>();
            acl.addAll(ZooDefs.Ids.CREATOR_ALL_ACL);
            acl.addAll(ZooDefs.Ids.READ_ACL_UNSAFE);
            builder = builder.authorization("digest", digest.getBytes(StandardCharsets.UTF_8))
                    .aclProvider(new ACLProvider() {
                        public List<ACL> getDefaultAcl() { return acl; }
                        public List<ACL> getAclForPath(String path) { return acl; }
                    });
        }
        client = builder.build();
        client.start();
        if (!client.blockUntilConnected(20, TimeUnit.SECONDS)) {
            say("- ERROR cannot connect to " + args[0]);
            System.exit(69);
        }
        say("- READY");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            String[] w = line.trim().split("\\s+");
            if (w.length < 2) {
                say("- ERROR bad command: " + line);
                continue;
            }
            String id = w[0];
            if (w[1].equals("quit")) {
                client.close();
                say(id + " BYE");
                System.exit(0);
            }
            Slot slot = slots.computeIfAbsent(id, Slot::new);
            slot.thread.submit(() -> {
                try {
                    run(slot, w);
                } catch (Throwable e) {
                    say(id + " ERROR " + e.toString().replace('\n', ' '));
                }
            });
        }
        // Stdin closed: the test is gone. Closing the client removes our nodes at once.
        client.close();
        System.exit(0);
    }

    static long ms(String[] w, int i) {
        return w.length > i ? Long.parseLong(w[i]) : -1;
    }

    static void run(Slot s, String[] w) throws Exception {
        String id = s.id;
        switch (w[1]) {
            case "mutex": {
                InterProcessMutex m = s.mutexes.computeIfAbsent(w[2], p -> new InterProcessMutex(client, p));
                acquireMutex(s, m, ms(w, 3));
                break;
            }
            case "revocable": {
                InterProcessMutex m = new InterProcessMutex(client, w[2]);
                // The listener runs on this id's thread, which owns the mutex.
                m.makeRevocable(lock -> {
                    say(id + " REVOKE_REQUESTED");
                    try {
                        lock.release();
                        s.held.removeIf(h -> h instanceof MutexHeld && ((MutexHeld) h).m == lock);
                        say(id + " RELEASED");
                    } catch (Exception e) {
                        say(id + " ERROR " + e);
                    }
                }, s.thread);
                acquireMutex(s, m, ms(w, 3));
                break;
            }
            case "semmutex": {
                InterProcessSemaphoreMutex m = new InterProcessSemaphoreMutex(client, w[2]);
                long t = ms(w, 3);
                boolean ok = true;
                if (t < 0) {
                    m.acquire();
                } else {
                    ok = m.acquire(t, TimeUnit.MILLISECONDS);
                }
                if (ok) {
                    s.held.push(m::release);
                    say(id + " ACQUIRED");
                } else {
                    say(id + " TIMEOUT");
                }
                break;
            }
            case "read":
            case "write": {
                InterProcessReadWriteLock rw = s.rw.computeIfAbsent(w[2], p -> new InterProcessReadWriteLock(client, p));
                InterProcessMutex m = w[1].equals("read") ? rw.readLock() : rw.writeLock();
                acquireMutex(s, m, ms(w, 3));
                break;
            }
            case "sem": {
                InterProcessSemaphoreV2 sem = new InterProcessSemaphoreV2(client, w[2], Integer.parseInt(w[3]));
                long t = ms(w, 4);
                Lease lease = t < 0 ? sem.acquire() : sem.acquire(t, TimeUnit.MILLISECONDS);
                if (lease == null) {
                    say(id + " TIMEOUT");
                } else {
                    s.held.push(lease::close);
                    say(id + " ACQUIRED " + lease.getNodeName());
                }
                break;
            }
            case "count": {
                int n = Integer.parseInt(w[3]);
                SharedCount c = count(w[2], n);
                c.setCount(n);
                say(id + " COUNT " + c.getCount());
                break;
            }
            case "semshared": {
                InterProcessSemaphoreV2 sem = new InterProcessSemaphoreV2(client, w[2], count(w[3], 1));
                long t = ms(w, 4);
                Lease lease = t < 0 ? sem.acquire() : sem.acquire(t, TimeUnit.MILLISECONDS);
                if (lease == null) {
                    say(id + " TIMEOUT");
                } else {
                    s.held.push(lease::close);
                    say(id + " ACQUIRED " + lease.getNodeName());
                }
                break;
            }
            case "release": {
                Held h = s.held.poll();
                if (h == null) {
                    say(id + " NOT_HELD");
                } else {
                    h.release();
                    say(id + " RELEASED");
                }
                break;
            }
            case "revoke": {
                Revoker.attemptRevoke(client, w[2]);
                say(id + " REVOKE_SENT");
                break;
            }
            case "children": {
                try {
                    List<String> kids = new ArrayList<>(client.getChildren().forPath(w[2]));
                    Collections.sort(kids);
                    say(id + " CHILDREN " + String.join(",", kids));
                } catch (KeeperException.NoNodeException e) {
                    say(id + " NONODE");
                }
                break;
            }
            case "data": {
                try {
                    byte[] d = client.getData().forPath(w[2]);
                    say(id + " DATA " + new String(d, StandardCharsets.UTF_8));
                } catch (KeeperException.NoNodeException e) {
                    say(id + " NONODE");
                }
                break;
            }
            case "latch":
            case "latchstart": {
                if (s.latch != null) {
                    s.latch.close();
                    s.latch = null;
                }
                LeaderLatch latch = new LeaderLatch(client, w[2], w[3]);
                latch.start();
                s.latch = latch;
                s.held.push(() -> {
                    if (s.latch == latch) {
                        s.latch = null;
                    }
                    latch.close();
                });
                if (w[1].equals("latchstart")) {
                    say(id + " STARTED");
                    break;
                }
                long t = ms(w, 4);
                boolean ok = true;
                if (t < 0) {
                    latch.await();
                } else {
                    ok = latch.await(t, TimeUnit.MILLISECONDS);
                }
                say(id + (ok ? " LEADER" : " TIMEOUT"));
                break;
            }
            case "leads": {
                say(id + " LEADS " + (s.latch != null && s.latch.hasLeadership()));
                break;
            }
            case "leader": {
                // A latch that is never started reads the path as any observer would.
                LeaderLatch observer = new LeaderLatch(client, w[2], "observer-" + id);
                Participant p = observer.getLeader();
                int n = observer.getParticipants().size();
                if (p.isLeader()) {
                    say(id + " LEADER " + p.getId() + " " + n);
                } else {
                    say(id + " NOBODY " + n);
                }
                break;
            }
            case "participants": {
                InterProcessMutex m = new InterProcessMutex(client, w[2]);
                say(id + " PARTICIPANTS " + m.getParticipantNodes().size());
                break;
            }
            default:
                say(id + " ERROR unknown command " + w[1]);
        }
    }

    static final class MutexHeld implements Held {
        final InterProcessMutex m;

        MutexHeld(InterProcessMutex m) {
            this.m = m;
        }

        public void release() throws Exception {
            m.release();
        }
    }

    static void acquireMutex(Slot s, InterProcessMutex m, long t) throws Exception {
        boolean ok = true;
        if (t < 0) {
            m.acquire();
        } else {
            ok = m.acquire(t, TimeUnit.MILLISECONDS);
        }
        if (ok) {
            s.held.push(new MutexHeld(m));
            say(s.id + " ACQUIRED");
        } else {
            say(s.id + " TIMEOUT");
        }
    }
}
